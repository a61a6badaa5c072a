"""SamplingParams refuses what it cannot honour, and each logits adjustment matches its definition computed
by hand on the same logits (no model needed)."""

import pytest
import torch

from carpool import SamplingParams
from carpool.engine.logits_processors import adjust_logits
from carpool.engine.sampler import sample
from carpool.engine.sequence import Sequence

VOCAB = 64
END_TOKENS = frozenset({2, 7})  # EOS and an end-of-turn token: min_tokens holds back both


@pytest.mark.parametrize(
    "field, kwargs",
    [
        ("temperature", {"temperature": float("inf")}),
        ("presence_penalty", {"presence_penalty": 2.5}),
        ("presence_penalty", {"presence_penalty": float("nan")}),
        ("frequency_penalty", {"frequency_penalty": -3}),
        ("repetition_penalty", {"repetition_penalty": 0}),
        ("repetition_penalty", {"repetition_penalty": float("inf")}),
        ("logit_bias", {"logit_bias": {"12": 1.0}}),
        ("logit_bias", {"logit_bias": {-1: 1.0}}),
        ("logit_bias", {"logit_bias": {12: 101}}),
        ("logit_bias", {"logit_bias": [12]}),
        ("min_tokens", {"min_tokens": -1}),
        ("min_tokens", {"max_tokens": 4, "min_tokens": 5}),
        ("bad_words", {"bad_words": [3]}),
        ("bad_words", {"bad_words": ["  "]}),
        ("bad_words", {"bad_words": ["\ud800"]}),
        ("stop", {"stop": ["ok", "\udfff"]}),
        ("best_of", {"best_of": 0}),
        ("best_of", {"best_of": 2.0}),
    ],
)
def test_bad_values_are_value_errors_naming_the_field(field, kwargs):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def sequence(params: SamplingParams, prompt: list[int], output: list[int], bad_words=None) -> Sequence:
    seq = Sequence("r", prompt, params, bad_words_token_ids=bad_words)
    seq.token_ids.extend(output)
    return seq


def test_no_adjustment_costs_no_copy():
    logits = torch.randn(3, VOCAB)
    seqs = [sequence(SamplingParams(), [1, 2], [3]) for _ in range(3)]
    assert adjust_logits(logits, seqs, END_TOKENS) is logits


def test_penalties_match_their_definitions():
    torch.manual_seed(0)
    logits = torch.randn(3, VOCAB) * 4
    prompt, output = [5, 6, 6, 7], [7, 8, 8, 8, 9]
    params = SamplingParams(presence_penalty=0.7, frequency_penalty=0.3, repetition_penalty=1.6)
    seqs = [
        sequence(SamplingParams(), prompt, output),
        sequence(params, prompt, output),
        sequence(SamplingParams(presence_penalty=-1.5), prompt, output),
    ]
    adjusted = adjust_logits(logits, seqs, END_TOKENS)

    expected = logits.clone()
    # Row 1. repetition_penalty (vLLM/HF): every token of prompt and output, positive logits divided, negative
    # multiplied; then OpenAI's frequency (per occurrence) and presence (once) over the output only.
    for token in set(prompt + output):
        value = expected[1, token]
        expected[1, token] = value / 1.6 if value > 0 else value * 1.6
    for token in set(output):
        expected[1, token] -= 0.3 * output.count(token) + 0.7
    for token in set(output):  # row 2: a negative presence penalty favours what was said
        expected[2, token] += 1.5
    torch.testing.assert_close(adjusted, expected)
    assert torch.equal(logits[0], adjusted[0])  # row 0 asked for nothing and got nothing

    greedy = [sequence(SamplingParams(temperature=0, presence_penalty=2.0), prompt, output)]
    tokens, _ = sample(logits[1:2], greedy, END_TOKENS)
    reference = logits[1].clone()
    reference[list(set(output))] -= 2.0
    assert tokens == [int(reference.argmax())]


def test_logit_bias_min_tokens_and_bad_words_match_their_definitions():
    logits = torch.randn(4, VOCAB)
    seqs = [
        sequence(SamplingParams(logit_bias={3: 100, 4: -100, 5: 0.5}), [1], [9]),
        sequence(SamplingParams(min_tokens=3, stop_token_ids=[11]), [1], [9]),  # 1 < 3 tokens out: banned
        sequence(SamplingParams(min_tokens=1, stop_token_ids=[11]), [1], [9]),  # 1 out: free again
        sequence(SamplingParams(), [1], [20, 21], bad_words=[[30], [21, 22], [20, 23], [40, 41]]),
    ]
    adjusted = adjust_logits(logits, seqs, END_TOKENS)
    expected = logits.clone()
    expected[0, 3] += 100
    expected[0, 4] -= 100
    expected[0, 5] += 0.5
    expected[1, [*END_TOKENS, 11]] = float("-inf")
    # A one-token bad word is always banned; a longer one where the output ends with the rest of it.
    expected[3, [30, 22]] = float("-inf")
    torch.testing.assert_close(adjusted, expected)


def test_min_tokens_keeps_eos_when_it_is_ignored_anyway():
    seq = sequence(SamplingParams(min_tokens=4, ignore_eos=True), [1], [])
    assert torch.isfinite(adjust_logits(torch.zeros(1, VOCAB), [seq], END_TOKENS)).all()


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": 1e-45},
        {"temperature": 1e-320},
        {"temperature": 1e-5},
        {"top_p": 1e-45},
        {"top_p": 1e-320},
        {"repetition_penalty": 1e-300},
    ],
)
def test_tiny_positive_values_sample_the_best_token_not_nan(kwargs):
    torch.manual_seed(1)
    logits = torch.randn(4, VOCAB) * 10
    seqs = [sequence(SamplingParams(seed=row, **kwargs), [7], [7]) for row in range(4)]
    tokens, _ = sample(logits, seqs, END_TOKENS)
    if "repetition_penalty" in kwargs:  # token 7 (seen): a positive logit divided past float32, a negative one to 0
        logits[:, 7] = torch.where(logits[:, 7] > 0, float("inf"), 0.0)
    assert tokens == logits.argmax(dim=-1).tolist()


def test_greedy_takes_the_first_of_equal_best_logits():
    """Ties go to the lowest token id, as torch.argmax breaks them (bf16 logits tie often), whichever reduction
    the sampler runs; a row of -inf but one token takes that token."""
    logits = torch.zeros(3, VOCAB)
    logits[0, [5, 9, VOCAB - 1]] = 2.0
    logits[1, [VOCAB - 2, VOCAB - 1]] = 1.0
    logits[2] = float("-inf")
    logits[2, 3] = -1e30
    seqs = [sequence(SamplingParams(temperature=0), [7], [7]) for _ in range(3)]
    tokens, _ = sample(logits, seqs, END_TOKENS)
    assert tokens == [5, VOCAB - 2, 3]
