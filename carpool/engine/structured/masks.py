"""The per-step token mask of constrained sequences: each keeps a matcher that follows its output tokens, and
only the rows of constrained sequences compute a mask (unconstrained rows are never touched).

A matcher catches up with its sequence's output lazily, at the next mask: whatever appended the tokens (one
sampled token, several accepted draft tokens) needs no hook, and a sequence whose output no longer extends what
the matcher consumed (rolled back) gets a fresh matcher replaying its output. Preemption keeps the output tokens,
so a recomputed sequence continues from the same grammar state.

A step's masks depend only on the output so far, so the engine asks for them before the forward pass
(`prefetch_grammar_masks`) and the sampler applies them after it (`apply_grammar_masks`). The masks are filled
one matcher after another on the calling thread, never by llguidance's parallel executor: its pool thread has to
win a core from the forward pass's OpenMP team, and on the 2-core dev machine a 32-row fill took 4-6 ms through
it against 0.06-0.13 ms inline (the same matchers, one thread). With a core to spare (more cores than torch
threads) the fill runs on a worker thread beside the forward pass (llguidance drops the GIL while it fills).

The packed masks are applied to the logits in place, 32 tokens (one int32 word) at a time, never unpacked whole:
a word that allows all 32 tokens is skipped, one that allows none is 32 floats of -inf, and only a mixed word is
read, bounded by its bytes' table of +-inf. A row that allows few words (a JSON structure: a key, a digit, a bracket) is filled with -inf and its
allowed words written back; a row that allows most (inside a string) writes -inf over its blocked words only.
Measured on the bench's schema, 32 rows of SmolLM2's vocabulary in 32 different states, 1 thread, CPU time
(loaded machine): 0.56 ms against 1.16 ms for unpacking every bit and one masked_fill_; and the sampler no
longer copies the logits for it (0.3-0.6 ms), since it masks in place. Through the engine (32 greedy streams,
the same state per step): 0.8 ms a step, where the fill of the 32 masks themselves costs 1.0 ms.
"""

import os
import threading
import weakref
from concurrent.futures import Future, ThreadPoolExecutor

import llguidance
import numpy as np
import torch

from carpool.engine.sequence import Sequence

_matchers: "weakref.WeakKeyDictionary[Sequence, SequenceMatcher]" = weakref.WeakKeyDictionary()
_worker: ThreadPoolExecutor | None = None
_prefetched = threading.local()  # per engine thread: the Future of the masks asked for before its forward pass
# A row with fewer than 1/FEW_WORDS of its words allowed is filled with -inf and its allowed words written back.
FEW_WORDS = 4
# For each byte of a mask word, its 8 tokens' upper bounds: +inf where allowed (the minimum keeps the logit bit for
# bit), -inf where not.
_BYTE_BOUNDS = np.where(
    np.unpackbits(np.arange(256, dtype=np.uint8)[:, None], axis=1, bitorder="little") == 1,
    np.float32(np.inf),
    np.float32(-np.inf),
)


class SequenceMatcher:
    def __init__(self, seq: Sequence):
        self.matcher = seq.params.structured.grammar.matcher()
        self.consumed: list[int] = []

    def follow(self, seq: Sequence) -> llguidance.LLMatcher:
        output = seq.output_token_ids
        if output[: len(self.consumed)] != self.consumed:
            self.matcher.reset()
            self.consumed = []
        new = output[len(self.consumed) :]
        if new:
            # A token the mask allowed is always accepted; one that is not (ignore_eos past the end) puts the
            # matcher in its error state, where the mask allows only the end tokens.
            self.matcher.consume_tokens(new)
            self.consumed = output
        return self.matcher


def matcher_of(seq: Sequence) -> llguidance.LLMatcher:
    state = _matchers.get(seq)
    if state is None:
        state = _matchers[seq] = SequenceMatcher(seq)
    return state.follow(seq)


class GrammarMasks:
    """The packed masks of some sequences' next tokens: bit t of row i set = token t allowed for seqs[i]; a
    matcher in its error state (a token it did not allow was forced in) is marked, to allow only the end tokens."""

    def __init__(self, seqs: list[Sequence], vocab: int):
        self.rows = {id(seq): i for i, seq in enumerate(seqs)}
        self.packed = np.empty((len(seqs), (vocab + 31) // 32), dtype=np.int32)
        self.errors = []
        row_bytes = self.packed.shape[1] * 4
        for i, seq in enumerate(seqs):
            matcher = matcher_of(seq)
            matcher.unsafe_compute_mask_ptr(self.packed.ctypes.data + i * row_bytes, row_bytes)
            if matcher.is_error():
                self.errors.append(i)

    def covers(self, seqs: list[Sequence]) -> bool:
        return all(id(seq) in self.rows for seq in seqs)

    def packed_rows(self, seqs: list[Sequence], end_token_ids: frozenset[int]) -> np.ndarray:
        """[len(seqs), words] int32, bit t of row i set = seqs[i] may take token t; a matcher in its error state
        allows only the end tokens."""
        packed = self.packed[[self.rows[id(seq)] for seq in seqs]]
        errors = [i for i, seq in enumerate(seqs) if self.rows[id(seq)] in self.errors]
        if errors:
            ends = np.zeros(packed.shape[1] * 32, dtype=bool)
            ends[sorted(end_token_ids)] = True
            packed[errors] = np.packbits(ends, bitorder="little").view(np.int32)
        return packed


def _constrained_to_sample(seqs: list[Sequence], num_new_tokens: list[int]) -> list[Sequence]:
    # A constrained sequence never speculates: it samples when this step reaches its last token.
    return [
        seq
        for seq, n in zip(seqs, num_new_tokens)
        if seq.params.structured and seq.num_computed_tokens + n == seq.num_tokens
    ]


def overlaps_forward() -> bool:
    """Whether prefetched masks are filled beside the forward pass: only with a core it does not use."""
    return (os.cpu_count() or 1) > torch.get_num_threads()


def prefetch_grammar_masks(seqs: list[Sequence], num_new_tokens: list[int], vocab: int) -> None:
    """Ask, before the forward pass, for the masks of the constrained sequences that sample this step."""
    global _worker
    _wait_prefetched()
    constrained = _constrained_to_sample(seqs, num_new_tokens)
    if not constrained:
        return
    if overlaps_forward():
        _worker = _worker or ThreadPoolExecutor(1, thread_name_prefix="carpool-grammar-masks")
        _prefetched.masks = _worker.submit(GrammarMasks, constrained, vocab)
    else:
        done = Future()
        done.set_result(GrammarMasks(constrained, vocab))
        _prefetched.masks = done


def _wait_prefetched() -> GrammarMasks | None:
    """The masks prefetched on this thread, once filled (a worker never touches a matcher after this returns)."""
    future = getattr(_prefetched, "masks", None)
    _prefetched.masks = None
    return None if future is None else future.result()


def apply_grammar_masks(
    logits: torch.Tensor, seqs: list[Sequence], rows: list[int], end_token_ids: frozenset[int]
) -> None:
    """Set to -inf, in place, every token the grammar of seqs[row] does not allow next, for each row in `rows`."""
    constrained = [seqs[row] for row in rows]
    masks = _wait_prefetched()
    if masks is None or not masks.covers(constrained):
        masks = GrammarMasks(constrained, logits.shape[-1])
    packed = masks.packed_rows(constrained, end_token_ids)
    if (
        logits.device.type == "cpu"
        and logits.dtype == torch.float32
        and logits.is_contiguous()
        and logits.shape[-1] % 32 == 0
    ):
        block_packed(logits.numpy(), np.asarray(rows), packed)
    else:  # another device, dtype or vocabulary size: unpacked to a bool per token and filled by torch
        blocked = np.unpackbits(np.invert(packed).view(np.uint8), axis=1, count=logits.shape[-1], bitorder="little")
        index = torch.tensor(rows, dtype=torch.long, device=logits.device)
        blocked = torch.from_numpy(blocked).view(torch.bool).to(logits.device)
        with torch.inference_mode():  # the model's logits are inference tensors: changed in place only inside it
            logits[index] = logits[index].masked_fill_(blocked, float("-inf"))


def block_packed(logits: np.ndarray, rows: np.ndarray, packed: np.ndarray) -> None:
    """In place: logits[rows[i], t] = -inf wherever bit t of packed[i] is clear (float32 [batch, vocab], C order,
    vocab a multiple of 32)."""
    per_row = logits.shape[1] // 32
    words = logits.view()
    words.shape = (-1, 32)  # word w of row r is words[r * per_row + w]; raises rather than copy
    allowed = packed != 0
    few = allowed.sum(axis=1) * FEW_WORDS < per_row
    # Rewritten from their bits: each allowed word of a `few` row (filled with -inf below), each mixed word of
    # the others. np.take, not fancy indexing: 5-10x faster for these gathers (numpy 2.3).
    rewritten = np.flatnonzero(np.where(few[:, None], allowed, allowed & (packed != -1)))
    index = rows[rewritten // per_row] * per_row + rewritten % per_row
    bounds = np.take(_BYTE_BOUNDS, np.take(packed, rewritten).view(np.uint8), axis=0).reshape(-1, 32)
    rewritten_words = np.minimum(np.take(words, index, axis=0), bounds)
    logits[rows[few]] = -np.inf
    blocked = np.flatnonzero(~(allowed | few[:, None]))  # words of the other rows that allow nothing
    words[rows[blocked // per_row] * per_row + blocked % per_row] = -np.inf
    words[index] = rewritten_words
