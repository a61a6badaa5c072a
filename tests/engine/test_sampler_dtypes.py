"""The sampler takes the LM head's logits in its own dtype (`CausalLM.compute_logits` no longer widens them):
tokens and logprobs from bf16 logits are those of the same values widened to fp32, for every kind of row."""

import pytest
import torch

from carpool import SamplingParams
from carpool.engine.sampler import filtered_probs, sample
from carpool.engine.sequence import Sequence

VOCAB = 1000
PLAIN = {  # rows no logits processor touches: the sampler reads the logits as they come
    "greedy": {"temperature": 0},
    "sampled": {"temperature": 0.8, "top_p": 0.9, "top_k": 50, "seed": 7},
    "logprobs": {"temperature": 0, "logprobs": 3},
    "sampled logprobs": {"temperature": 1.0, "seed": 3, "logprobs": 2},
}
ADJUSTED = {  # with them in the batch, every row is sampled from an adjusted fp32 copy
    "penalized": {"temperature": 0, "repetition_penalty": 1.5, "frequency_penalty": 0.5},
    "biased": {"temperature": 0, "logit_bias": {5: 100.0}},
}


def sequences(kinds: dict) -> list[Sequence]:
    return [Sequence(kind, [11, 12, 13, 11], SamplingParams(max_tokens=8, **params)) for kind, params in kinds.items()]


@pytest.mark.parametrize("kinds", [PLAIN, PLAIN | ADJUSTED], ids=["plain", "adjusted"])
def test_bf16_logits_sample_as_their_fp32_widening(kinds):
    logits = (torch.randn(len(kinds), VOCAB, generator=torch.Generator().manual_seed(0)) * 4).bfloat16()
    logits[:, 11] = logits.max() + 1  # the prompt's token ahead, so that a penalty changes the greedy pick
    wide = logits.float()
    tokens, logprobs = sample(logits.clone(), sequences(kinds))
    wide_tokens, wide_logprobs = sample(wide.clone(), sequences(kinds))
    assert tokens == wide_tokens and logprobs == wide_logprobs
    assert [lp is not None for lp in logprobs] == ["logprobs" in params for params in kinds.values()]
    if kinds is not PLAIN:
        assert tokens[list(kinds).index("penalized")] != 11 and tokens[list(kinds).index("biased")] == 5
    for row, seq in enumerate(sequences(kinds)):
        if not seq.params.greedy:
            assert torch.equal(
                filtered_probs(logits[row], seq, frozenset()), filtered_probs(wide[row], seq, frozenset())
            )
