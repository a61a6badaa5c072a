"""Applying packed grammar masks word by word is exact: every token whose bit is clear becomes -inf, every other
logit is untouched (bit for bit), in the rows asked for only, whatever mix of all-allowed, all-blocked and mixed
words a row has; and the sampler masks a grammar-only batch in place instead of copying the logits."""

import numpy as np
import pytest
import torch

from carpool import SamplingParams
from carpool.engine.sampler import sample
from carpool.engine.sequence import Sequence
from carpool.engine.structured import StructuredOutput
from carpool.engine.structured.masks import apply_grammar_masks, block_packed


def reference(logits: torch.Tensor, rows: list[int], packed: np.ndarray) -> torch.Tensor:
    """The obvious way: unpack each row's bits to one bool per token and fill."""
    expected = logits.clone()
    vocab = logits.shape[1]
    for i, row in enumerate(rows):
        allowed = np.unpackbits(packed[i].view(np.uint8), count=vocab, bitorder="little").astype(bool)
        expected[row, torch.from_numpy(~allowed)] = float("-inf")
    return expected


def masks(rng: np.random.Generator, count: int, vocab: int) -> np.ndarray:
    """Rows like a grammar's: a few allowed tokens (a JSON structure), most allowed (inside a string), random
    bits, every token allowed, and a row whose bits past the vocabulary are set."""
    words = (vocab + 31) // 32
    kinds = []
    for i in range(count):
        bits = np.zeros(words * 32, dtype=bool)
        kind = i % 5
        if kind == 0:
            bits[rng.choice(vocab, 3, replace=False)] = True
        elif kind == 1:
            bits[:vocab] = True
            bits[rng.choice(vocab, vocab // 20, replace=False)] = False
        elif kind == 2:
            bits[:vocab] = rng.random(vocab) < 0.5
        elif kind == 3:
            bits[:vocab] = True
        else:
            bits[rng.choice(vocab, vocab // 3, replace=False)] = True
            bits[vocab:] = True
        kinds.append(np.packbits(bits, bitorder="little").view(np.int32))
    return np.stack(kinds)


@pytest.mark.parametrize("vocab", [49152, 2048])
def test_word_wise_masking_equals_unpacking_every_token(vocab):
    rng = np.random.default_rng(vocab)
    logits = torch.randn(12, vocab)
    rows = [0, 2, 3, 5, 6, 7, 9, 10, 11, 1]
    packed = masks(rng, len(rows), vocab)
    # The largest logit of every masked row sits on a token its mask blocks.
    for i, row in enumerate(rows):
        blocked = np.flatnonzero(~np.unpackbits(packed[i].view(np.uint8), count=vocab, bitorder="little").astype(bool))
        if len(blocked):
            logits[row, blocked[0]] = 100.0
    expected = reference(logits, rows, packed)
    got = logits.clone()
    block_packed(got.numpy(), np.asarray(rows), packed)
    assert torch.equal(got, expected)
    assert torch.equal(got[[4, 8]], logits[[4, 8]])  # rows not asked for are untouched
    for i, row in enumerate(rows):  # the winner is always an allowed token
        winner = int(got[row].argmax())
        assert packed[i][winner // 32] >> (winner % 32) & 1


def constrained_seq(request_id: str, **kwargs) -> Sequence:
    params = SamplingParams(
        **{"max_tokens": 4, "temperature": 0} | kwargs, structured=StructuredOutput("choice", ["x"])
    )
    return Sequence(request_id, [1, 2, 3], params)


def serve_masks(monkeypatch, packed: np.ndarray) -> None:
    """The grammar masks of any step are `packed` (no matcher runs)."""

    class Fixed:
        def __init__(self, seqs, vocab):
            pass

        def covers(self, seqs):
            return False  # so whatever the engine thread prefetched before is not used either

        def packed_rows(self, seqs, end_token_ids):
            return packed.copy()

    monkeypatch.setattr("carpool.engine.structured.masks.GrammarMasks", Fixed)


def test_a_grammar_only_batch_is_masked_in_place_and_other_rows_untouched(monkeypatch):
    vocab, allowed = 64, [7, 40]  # the one token each constrained row allows
    packed = np.zeros((2, 2), dtype=np.int32)
    for i, token in enumerate(allowed):
        packed[i, token // 32] = np.int32(1 << (token % 32))
    serve_masks(monkeypatch, packed)
    seqs = [
        constrained_seq("a"),
        Sequence("b", [1, 2, 3], SamplingParams(max_tokens=4, temperature=0)),
        constrained_seq("c"),
    ]
    logits = torch.randn(3, vocab)
    before = logits.clone()
    tokens, _ = sample(logits, seqs)
    assert tokens == [7, int(before[1].argmax()), 40]
    assert all(int(torch.isinf(logits[row]).sum()) == vocab - 1 for row in (0, 2))  # masked in place: no copy
    assert torch.equal(logits[1], before[1])
    # A constrained row that reports logprobs reads them from the raw logits, which then stay unmasked.
    seqs[0] = constrained_seq("a", logprobs=1)
    logits = before.clone()
    _, logprobs = sample(logits, seqs)
    assert torch.equal(logits, before)
    assert logprobs[0].logprob == pytest.approx(float(torch.log_softmax(before[0], -1)[7]))


@pytest.mark.parametrize("dtype, vocab", [(torch.float32, 49152), (torch.float64, 2048), (torch.float32, 1000)])
def test_every_dtype_and_vocabulary_size_masks_the_same(monkeypatch, dtype, vocab):
    """float32 with whole words: word by word in numpy; other dtypes, or a partial last word: torch's fill."""
    rows = [2, 0, 3]
    packed = masks(np.random.default_rng(vocab), len(rows), vocab)
    serve_masks(monkeypatch, packed)
    with torch.inference_mode():  # as the model runner makes them (CUDA's fp32 logits take torch's fill)
        logits = torch.randn(4, vocab, dtype=dtype)
    expected = reference(logits, rows, packed)
    apply_grammar_masks(logits, [constrained_seq(str(i)) for i in range(4)], rows, frozenset())
    assert torch.equal(logits, expected)


def test_a_matcher_forced_off_its_grammar_allows_only_the_end_tokens():
    """ignore_eos past the grammar's end appends a token the mask did not allow: the matcher errs, and from then
    on only the end tokens are allowed (the output cannot grow into something the grammar never accepts)."""
    from carpool.engine.structured.grammars import GrammarCompiler
    from carpool.engine.structured.masks import GrammarMasks
    from carpool.models.loader import resolve_model_dir
    from carpool.models.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_dir(resolve_model_dir("smollm2-135m"))
    vocab = 49152
    spec = GrammarCompiler(tokenizer, vocab).bind(StructuredOutput("choice", ["yes"]))
    seq = Sequence("s", [1, 2, 3], SamplingParams(max_tokens=8, structured=spec))
    seq.token_ids += tokenizer.encode("yes", add_special_tokens=False) + tokenizer.encode(
        " no", add_special_tokens=False
    )
    ends = frozenset({0, 2, 7})
    packed = GrammarMasks([seq], vocab).packed_rows([seq], ends)
    allowed = np.flatnonzero(np.unpackbits(packed[0].view(np.uint8), bitorder="little"))
    assert set(allowed) == ends
