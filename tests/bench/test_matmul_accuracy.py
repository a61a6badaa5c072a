"""The matmul accuracy bench's prefill mode scores every position of the prompt from one prefill step: the same
distributions as the positions fed one token a step."""

import torch

from carpool.bench.matmul_accuracy import next_token_logprobs

TOKENS = list(range(2000, 2012))


def test_prefill_mode_scores_every_position_of_the_prompt():
    prefill = next_token_logprobs("smollm2-135m", "exact", TOKENS, "float32", prefill=True)
    stepwise = next_token_logprobs("smollm2-135m", "exact", TOKENS, "float32", prefill=False)
    assert prefill.shape == stepwise.shape == (len(TOKENS), prefill.shape[1])
    torch.testing.assert_close(prefill, stepwise, rtol=0, atol=2e-3)  # fp32: only summation order differs
