"""carpool's Llama against transformers' own implementation, on the same GGUF weights."""

from pathlib import Path

import pytest
import torch

from carpool import SamplingParams
from carpool.models.loader import default_model_path

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "Explain photosynthesis in one sentence:",
    "1, 2, 3, 4, 5,",
    "The best way to learn a new language is",
    "Translate to French: Good morning, my friend.",
    "Q: What is 17 times 3?\nA:",
]


@pytest.fixture(scope="module")
def hf_model():
    transformers = pytest.importorskip("transformers")
    path = Path(default_model_path())
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    )
    model.generation_config.eos_token_id = None  # run the full 64 tokens, as ignore_eos does on our side
    return model.eval()


def test_greedy_outputs_match_transformers(llm, hf_model):
    prompts = [llm.tokenizer.encode(p) for p in PROMPTS]
    ours = llm.generate(prompts, SamplingParams(max_tokens=64, temperature=0, ignore_eos=True))
    for prompt, output in zip(prompts, ours):
        with torch.inference_mode():
            reference = hf_model.generate(
                torch.tensor([prompt]),
                max_new_tokens=64,
                do_sample=False,
                pad_token_id=0,
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            )[0, len(prompt) :].tolist()
        assert output.token_ids == reference


@pytest.fixture(scope="module")
def dense_llm():
    """The same model with every weight dequantized (quantization="none"): the dense reference path."""
    from carpool import LLM

    return LLM(dtype="float32", quantization="none", max_num_seqs=2)


@pytest.mark.parametrize("weights", ["gguf blocks", "dense"])
def test_last_position_logits_match_transformers(llm, dense_llm, hf_model, weights):
    engine = (llm if weights == "gguf blocks" else dense_llm).engine
    for text in PROMPTS:
        prompt = llm.tokenizer.encode(text)
        with torch.inference_mode():
            expected = hf_model(torch.tensor([prompt])).logits[0, -1]
        seq = engine.add_request("logits-check", prompt, SamplingParams(max_tokens=1))
        batch = engine.scheduler.schedule()
        logits, sampled = engine.runner.run(batch)
        engine.abort("logits-check")
        assert sampled == [seq]
        assert (logits[0] - expected).abs().max().item() < 1e-3


def test_tokenizer_matches_transformers_gguf_tokenizer(tokenizer):
    transformers = pytest.importorskip("transformers")
    path = Path(default_model_path())
    reference = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    texts = PROMPTS + ["Numbers 12345 and 3.14159!", "  leading spaces\nand\ttabs", "émigré café naïve 日本語"]
    for text in texts:
        assert tokenizer.encode(text) == reference.encode(text, add_special_tokens=False)
        assert tokenizer.decode(tokenizer.encode(text)) == text


def test_bfloat16_tracks_float32(llm):
    """The bf16 path (the default where the CPU has bf16 units) stays close to the exact fp32 model."""
    from carpool import LLM

    fast = LLM(dtype="bfloat16", max_num_seqs=8, matmul="exact")
    prompts = [llm.tokenizer.encode(p) for p in PROMPTS]
    params = SamplingParams(max_tokens=1, temperature=0, logprobs=5)
    exact = llm.generate(prompts, params)
    approx = fast.generate(prompts, params)
    agree = sum(a.token_ids == b.token_ids for a, b in zip(exact, approx))
    assert agree >= len(PROMPTS) - 1
    for a, b in zip(exact, approx):
        if a.token_ids == b.token_ids:
            assert abs(a.logprobs[0].logprob - b.logprobs[0].logprob) < 0.1
