"""A cheap draft model: a subset of the vocabulary in its LM head and its own weight format. The target still
verifies every draft, so greedy output stays the target's token for token, and a sampled draft's q is the
distribution it drew from (zero outside the subset), which keeps rejection sampling exact."""

import dataclasses

import gguf
import pytest
import torch

from carpool import LLM
from carpool.cli import main
from carpool.engine.sampling_params import SamplingParams
from carpool.engine.sequence import Sequence
from carpool.engine.spec_decode import rejection_sampler
from carpool.engine.spec_decode.draft_model import DraftModelDrafter
from carpool.models import load_model
from tests.engine.test_spec_decode import EXACT, PROMPTS, SIGNIFICANCE, chi_square_p_value

SUBSET = 4096  # of SmolLM2's 49,152 tokens: small enough that the prompts' continuations leave it
GREEDY = SamplingParams(max_tokens=16, temperature=0)


@pytest.fixture(scope="module")
def cheap_draft_llm():
    """SmolLM2 drafting for itself from its first 4096 token ids, its weights re-quantized to Q4_0."""
    llm = LLM(
        speculative_model="smollm2-135m",
        speculative_vocab_size=SUBSET,
        speculative_quantization="q4_0",
        num_speculative_tokens=3,
        max_num_seqs=8,
        **EXACT,
    )
    llm.engine.speculator.policy.num_drafts = lambda batch_size: 3  # the policy would turn self-drafting off
    return llm


def test_the_draft_head_computes_the_subset_in_its_own_format(cheap_draft_llm):
    drafter = cheap_draft_llm.engine.speculator.drafter
    ids = drafter.draft_ids.tolist()
    assert ids[:SUBSET] == list(range(SUBSET)) and ids == sorted(set(ids))
    assert set(ids[SUBSET:]) == {
        i
        for i in cheap_draft_llm.engine.tokenizer.added_token_ids | cheap_draft_llm.engine.tokenizer.stop_token_ids
        if i >= SUBSET
    }
    head = drafter.model.lm_head
    assert head.out_features == len(ids) and head.ggml_type == gguf.GGMLQuantizationType.Q4_0
    # The target keeps its own format: dense float32.
    assert not hasattr(cheap_draft_llm.engine.model.lm_head, "qtype")


def test_greedy_output_is_the_target_s_and_drafts_stay_in_the_subset(cheap_draft_llm):
    plain = cheap_draft_llm.generate(PROMPTS, dataclasses.replace(GREEDY, speculative=False))  # no drafts
    assert any(t >= SUBSET for output in plain for t in output.token_ids)  # the target leaves the subset
    drafter = cheap_draft_llm.engine.speculator.drafter
    drafts, propose = [], drafter.propose

    def recorded(seqs):
        propose(seqs)
        drafts.extend(t for seq in seqs for t in seq.spec_token_ids)

    drafter.propose = recorded
    try:
        fast = cheap_draft_llm.generate(PROMPTS, GREEDY)
    finally:
        drafter.propose = propose
    assert [o.token_ids for o in fast] == [o.token_ids for o in plain]
    assert drafts and set(drafts) <= set(drafter.draft_ids.tolist())


def test_a_sampled_draft_s_q_is_zero_outside_the_subset(cheap_draft_llm):
    drafter = cheap_draft_llm.engine.speculator.drafter
    seq = Sequence(
        "sampled",
        cheap_draft_llm.engine.door.tokenize_prompt(PROMPTS[0]),
        SamplingParams(max_tokens=8, temperature=1.5, seed=1),
    )
    seq.num_lookahead_tokens = 3
    try:
        drafter.propose([seq])
    finally:
        drafter.retain(set())
    outside = torch.ones(drafter.vocab_size, dtype=torch.bool)
    outside[drafter.draft_ids] = False
    assert seq.spec_probs.shape == (3, drafter.vocab_size)
    assert torch.allclose(seq.spec_probs.sum(-1), torch.ones(3)) and not seq.spec_probs[:, outside].any()


def test_subset_drafts_keep_the_target_distribution():
    """2000 seeded draws: drafts sampled by a drafter from its subset's logits (one of them a special token past
    the first ids), then verified against a target with 35% of its mass outside the subset. The emitted token
    follows the target (chi-square at 0.1%)."""
    model, _, _ = load_model(None, "cpu", torch.float32, "none")
    vocab, special = SUBSET + 2048, SUBSET + 1000  # the target's first ids: vectors 8x shorter than SmolLM2's
    drafter = DraftModelDrafter(
        "smollm2-135m",
        model,
        4,
        16,
        torch.device("cpu"),
        torch.float32,
        vocab,
        frozenset(),
        True,
        SUBSET,
        frozenset({special}),
    )
    assert drafter.draft_ids[-1] == special
    inside, outside = [5, 300, special], [SUBSET + 10, SUBSET + 2000]
    p = torch.zeros(vocab)
    p[inside + outside] = torch.tensor([0.30, 0.20, 0.15, 0.25, 0.10])
    p = p.repeat(2, 1)  # the first draft's row and the bonus row
    logits = torch.full((len(drafter.draft_ids),), float("-inf"))
    logits[[5, 300, SUBSET]] = torch.tensor([0.60, 0.30, 0.10]).log()  # the rows of the drafter's head
    counts, drafted = torch.zeros(vocab, dtype=torch.float64), torch.zeros(vocab, dtype=torch.float64)
    for i in range(2000):
        seq = Sequence("draw", [1, 2, 3], SamplingParams(max_tokens=4, temperature=1.0, seed=i))
        seq.spec_token_ids, q = [], []
        seq.spec_token_ids.append(drafter._draft(logits, seq, q))
        drafted[seq.spec_token_ids[0]] += 1
        generators = [torch.Generator().manual_seed(7919 * i + j) for j in range(2)]
        counts[rejection_sampler.rejection_sample(p, torch.stack(q), seq.spec_token_ids, generators)[0]] += 1
    assert drafted[inside].sum() == 2000 and drafted[special] > 0  # each logit row maps to its own token
    assert chi_square_p_value(drafted, q[0]) > SIGNIFICANCE  # drafts follow the q handed to verification
    assert counts[outside].sum() > 0 and counts[special] > 0
    assert chi_square_p_value(counts, p[0]) > SIGNIFICANCE
    greedy = Sequence("greedy", [1, 2, 3], SamplingParams(max_tokens=4, temperature=0))
    logits[SUBSET] = 0.0  # the special token's row is now the largest logit
    assert drafter._draft(logits, greedy, []) == special


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("speculative_vocab_size", 0, "speculative_vocab_size must be a positive integer"),
        ("speculative_vocab_size", -5, "speculative_vocab_size must be a positive integer"),
        ("speculative_vocab_size", 100_000, "speculative_vocab_size must not exceed the draft model's vocabulary"),
        ("speculative_quantization", "q3_k", "speculative_quantization must be one of"),
    ],
)
def test_bad_draft_settings_are_errors_naming_the_field(field, value, message):
    with pytest.raises(ValueError, match=message):
        LLM(speculative_model="smollm2-135m", **{field: value})


@pytest.mark.parametrize("field", ["quantization", "speculative_quantization"])
def test_a_cpu_weight_format_on_another_device_is_an_error_naming_its_own_field(field):
    # checked before any weights load, so no CUDA device is needed to see it refused
    with pytest.raises(ValueError, match=f"^{field}: q4_0 runs on CPU kernels; on cuda"):
        LLM(speculative_model="smollm2-135m", device="cuda", **{field: "q4_0"})


def test_the_cli_names_a_bad_draft_setting(capsys):
    assert main(["generate", "hi", "--speculative-model", "smollm2-135m", "--speculative-vocab-size", "0"]) == 2
    assert "speculative_vocab_size must be a positive integer" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["generate", "hi", "--speculative-model", "smollm2-135m", "--speculative-quantization", "q3_k"])
    assert "--speculative-quantization: invalid choice" in capsys.readouterr().err
