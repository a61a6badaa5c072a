"""Qwen2 and Gemma 3 against transformers' own implementations, loaded from the same GGUF files."""

import pytest
import torch

from carpool import SamplingParams

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "用一句话解释光合作用：",
    "Q: What is 17 times 3?\nA:",
]
# Longer than Gemma 3's 512-token sliding window and than one step's 512-token prefill budget: the prompt is
# prefilled in two chunks and every generated token decodes past the window.
LONG_PROMPT = " ".join(
    f"Item {i}: the {['red', 'green', 'blue'][i % 3]} box holds {i * 7 % 13} stones." for i in range(50)
)
LONG_PROMPT += "\nCount the boxes that hold more than six stones. Answer:"
NEW_TOKENS = 16
EXACT_LOGITS_TOLERANCE = 1e-3  # fp32 both sides, the same weights: sums in another order (measured ~6e-5)
# The block kernels compute from the file's blocks in their own order (the reference dequantizes them first).
BLOCK_LOGITS_TOLERANCE = 2e-2


def _reference_tokens(hf, prompt: list[int]) -> list[int]:
    with torch.inference_mode():
        out = hf.generate(
            torch.tensor([prompt]),
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            pad_token_id=0,
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        )
    return out[0, len(prompt) :].tolist()


def test_greedy_tokens_match_transformers(real_model):
    llm = real_model.exact
    texts = PROMPTS + ([LONG_PROMPT] if llm.engine.model_config.sliding_window else [])
    prompts = [llm.tokenizer.encode(text) for text in texts]
    if llm.engine.model_config.sliding_window:
        assert len(prompts[-1]) > max(llm.engine.model_config.sliding_window, llm.engine.config.max_num_batched_tokens)
    ours = llm.generate(prompts, SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True))
    for text, prompt, output in zip(texts, prompts, ours):
        assert output.token_ids == _reference_tokens(real_model.hf, prompt), text[:40]


def _last_logits(llm, prompt: list[int]) -> torch.Tensor:
    engine = llm.engine
    seq = engine.add_request("logits-check", prompt, SamplingParams(max_tokens=1))
    logits, sampled = engine.runner.run(engine.scheduler.schedule())
    engine.abort("logits-check")
    assert sampled == [seq]
    return logits[0]


@pytest.mark.parametrize("weights", ["exact", "blocks"])
def test_last_position_logits_match_transformers(real_model, weights):
    llm = getattr(real_model, weights)
    tolerance = EXACT_LOGITS_TOLERANCE if weights == "exact" else BLOCK_LOGITS_TOLERANCE
    for text in PROMPTS:
        prompt = llm.tokenizer.encode(text)
        with torch.inference_mode():
            expected = real_model.hf(torch.tensor([prompt])).logits[0, -1]
        assert (_last_logits(llm, prompt) - expected).abs().max().item() < tolerance, text


def test_blocks_stay_in_the_files_formats(real_model):
    """quantization="auto" runs every projection from the file's own blocks: no dense Linear is left."""
    from carpool.models.quantization import GGMLLinear

    model = real_model.blocks.engine.model
    assert not any(isinstance(m, torch.nn.Linear) for m in model.modules())
    assert sum(isinstance(m, GGMLLinear) for m in model.modules()) >= 4 * model.config.num_layers
