"""prompt_logprobs: each prompt token's logprob given the tokens before it, as a full forward of the prompt gives
them, whatever the chunking, and also when the prompt's blocks sit in the prefix cache (they are recomputed)."""

import pytest
import torch

from carpool import SamplingParams

PROMPT = (
    "Prompt logprobs check: the quick brown fox jumps over the lazy dog, then the dog sleeps while the fox "
    "writes a short poem about autumn leaves and quiet rivers."
)


def full_forward_logprobs(llm, prompt_ids: list[int]) -> torch.Tensor:
    """log_softmax of the model's logits at every prompt position, from one forward pass over the whole prompt
    (the engine's own step, watched: its hidden states for all positions, projected here)."""
    model = llm.engine.model
    forward, seen = model.forward, []

    def watch(input_ids, positions):
        hidden = forward(input_ids, positions)
        if input_ids.tolist() == prompt_ids:
            seen.append(hidden)
        return hidden

    model.forward = watch
    try:
        llm.generate([prompt_ids], SamplingParams(max_tokens=1, temperature=0))
    finally:
        model.forward = forward
    assert len(seen) == 1, "the reference prompt must be prefilled in one step"
    return torch.log_softmax(model.compute_logits(seen[0]).float(), dim=-1)


def test_prompt_logprobs_match_a_full_forward_when_chunked_and_cached(llm, tokenizer):
    prompt_ids = tokenizer.encode(PROMPT)
    assert len(prompt_ids) > 2 * 16  # three chunks at least
    reference = full_forward_logprobs(llm, prompt_ids)  # leaves the prompt's full blocks in the prefix cache
    config = llm.engine.config
    budget, config.max_num_batched_tokens = config.max_num_batched_tokens, 16  # prefill in chunks of 16
    try:
        asked, plain = llm.generate(
            [prompt_ids, prompt_ids],
            [
                SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=3),
                SamplingParams(max_tokens=1, temperature=0),
            ],
        )
    finally:
        config.max_num_batched_tokens = budget
    assert plain.prompt_logprobs is None and plain.num_cached_tokens > 0  # the cache is there to hit
    assert asked.num_cached_tokens == 0  # ...but a request asking for prompt logprobs computes every token
    got = asked.prompt_logprobs
    assert len(got) == len(prompt_ids) and got[0] is None
    for position, entry in enumerate(got[1:], start=1):
        row = reference[position - 1]
        assert entry.token_id == prompt_ids[position]
        assert entry.logprob == pytest.approx(float(row[prompt_ids[position]]), abs=1e-3)
        above = [int((row > entry.logprob + sign * 1e-3).sum()) + 1 for sign in (1, -1)]
        assert above[0] <= entry.rank <= above[1]  # the rank among all tokens, up to near ties
        top = torch.topk(row, 3)
        assert [t for t, _ in entry.top] == top.indices.tolist()
        assert [v for _, v in entry.top] == pytest.approx(top.values.tolist(), abs=1e-3)


def test_prompt_logprobs_zero_has_no_alternatives_and_bad_values_are_refused(llm):
    output = llm.generate(["One two three four"], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0))[0]
    assert all(entry.top == [] for entry in output.prompt_logprobs[1:])
    for bad in (-1, 21, 1.5, True):
        with pytest.raises(ValueError, match="prompt_logprobs"):
            SamplingParams(prompt_logprobs=bad)


def test_a_later_start_reads_the_prefix_from_the_cache_and_scores_the_rest_alike(llm, tokenizer):
    prompt_ids = tokenizer.encode(PROMPT + " Then it rains.")
    every = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0)
    whole = llm.generate([prompt_ids], every)[0]  # leaves the prompt's full blocks in the prefix cache
    start = len(prompt_ids) - 5
    later = llm.generate(
        [prompt_ids], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0, prompt_logprobs_start=start)
    )[0]
    block = llm.engine.config.block_size
    assert whole.num_cached_tokens == 0
    assert later.num_cached_tokens == (start - 1) // block * block > 0  # row start - 1 is computed: it is read
    assert later.prompt_logprobs[:start] == [None] * start and len(later.prompt_logprobs) == len(prompt_ids)
    for position in range(start, len(prompt_ids)):
        assert later.prompt_logprobs[position].token_id == prompt_ids[position]
        assert later.prompt_logprobs[position].logprob == pytest.approx(
            whole.prompt_logprobs[position].logprob, abs=1e-3
        )
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="prompt_logprobs_start"):
            SamplingParams(prompt_logprobs=0, prompt_logprobs_start=bad)
