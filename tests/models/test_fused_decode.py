"""The fused decode step (one C++ call for every decoder layer, carpool/kernels/csrc/decode_layer.cpp) computes
what the Python layers compute: every decode-only step of a run is computed both ways and their logits compared,
on the three architectures' real GGUF files (Qwen2.5-0.5B's q/k/v are split parts of two block types, Gemma 3
has q/k norms, sandwich norms, GeGLU and sliding-window layers), in fp32 and bf16, and dense; one sequence and
then three with different context lengths (one past Gemma's 512-key window)."""

import pytest
import torch

from carpool import LLM, SamplingParams
from carpool.models.attention import decode_only_metadata

# (model, dtype, quantization): GGUF blocks in both dtypes, and dense matrices (Qwen2's q/k/v bias then rides
# in the one dense matmul, as F.linear's).
CASES = [
    *(
        (name, dtype, "auto")
        for name in ("smollm2-135m", "qwen2.5-coder-0.5b", "gemma-3-270m")
        for dtype in ("float32", "bfloat16")
    ),
    ("qwen2.5-coder-0.5b", "float32", "none"),
]
STEPS = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)


class BothPaths:
    """Wraps a model's forward: a decode-only step runs the Python layers first, then the fused call (both write
    the same cache slots; the fused call's keys are the ones later steps read), and their logits are kept."""

    def __init__(self, model):
        self.model, self.forward = model, model.forward
        self.pairs = []  # (batch size, python logits, fused logits)

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if decode_only_metadata(input_ids.numel()) is None:
            return self.forward(input_ids, positions)
        self.model.fused_decode = False
        python = self.model.compute_logits(self.forward(input_ids, positions))
        self.model.fused_decode = True
        hidden = self.forward(input_ids, positions)
        self.pairs.append((input_ids.numel(), python, self.model.compute_logits(hidden)))
        return hidden


def prompt(words: int) -> str:
    return " ".join(f"word{i % 50}" for i in range(words))


@pytest.mark.parametrize(("name", "dtype", "quantization"), CASES)
def test_fused_decode_logits_equal_the_python_layers(name, dtype, quantization):
    # Every prompt prefilled in one step, so that the three sequences then decode together.
    llm = LLM(
        model=name,
        dtype=dtype,
        quantization=quantization,
        max_num_seqs=4,
        num_kv_blocks=256,
        max_num_batched_tokens=1024,
    )
    model = llm.engine.model
    both = BothPaths(model)
    model.forward = both
    fused_calls = []
    fused = model._fused_decode
    model._fused_decode = lambda *args: fused_calls.append(1) or fused(*args)

    llm.generate([prompt(8)], STEPS)  # batch 1
    window = model.config.sliding_window or 0
    llm.generate([prompt(3), prompt(40), prompt(window + 20 if window else 120)], STEPS)  # batch 3, one past the window

    assert len(fused_calls) == len(both.pairs) >= 2 * (STEPS.max_tokens - 1)
    assert {batch for batch, _, _ in both.pairs} == {1, 3}
    # The same kernels in the same order: equal up to float noise (measured: bit-identical).
    tolerance = 1e-4 if dtype == "float32" else 1e-2
    for batch, python, fused_logits in both.pairs:
        assert fused_logits.shape == python.shape == (batch, model.config.vocab_size)
        torch.testing.assert_close(fused_logits, python, rtol=0, atol=tolerance)


def test_verification_rows_run_fused_with_a_causal_window():
    """A step verifying speculative drafts (k + 1 query rows per sequence, beside plain decodes) stays one fused
    call, and each row sees exactly the keys up to its own position: the fused logits equal the Python layers',
    and greedy output equals the engine's without speculation (a row that saw a later draft's key would not)."""
    exact = {"dtype": "float32", "quantization": "none", "max_num_seqs": 4}
    prompts = [prompt(30), "The cat sat on the mat. The dog sat on the log. The cat", prompt(7)]
    steps = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    plain = LLM(**exact).generate(prompts, steps)
    llm = LLM(speculative_model="ngram", num_speculative_tokens=3, **exact)
    llm.engine.speculator.policy.num_drafts = lambda batch_size: 3
    model = llm.engine.model
    both = BothPaths(model)
    model.forward = both
    outputs = llm.generate(prompts, steps)
    assert [o.token_ids for o in outputs] == [o.token_ids for o in plain]
    verify_steps = [(rows, python, fused) for rows, python, fused in both.pairs if rows > 3]
    assert verify_steps  # some steps verified drafts, through the fused call
    for rows, python, fused_logits in verify_steps:
        torch.testing.assert_close(fused_logits, python, rtol=0, atol=1e-4)
