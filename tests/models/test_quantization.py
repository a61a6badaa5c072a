"""Weights in GGML blocks: which modules get them, and that the model still computes the same function."""

import gguf
import pytest
import torch

from carpool import LLM, SamplingParams
from carpool.engine.config import EngineConfig
from carpool.models.quantization import GGMLEmbedding, GGMLLinear, GGMLWeight, resolve_weights

from test_reference import PROMPTS


def block_types(model) -> dict[str, str]:
    return {
        name: gguf.GGMLQuantizationType(module.qtype).name
        for name, module in model.named_modules()
        if isinstance(module, (GGMLLinear, GGMLEmbedding))
    }


def test_auto_keeps_the_gguf_files_own_blocks(llm):
    """SmolLM2's GGUF stores the projections in Q4_1 and the tied embedding in Q8_0: they stay so, fused."""
    types = block_types(llm.engine.model)
    layers = llm.engine.model_config.num_layers
    assert sum(t == "Q4_1" for t in types.values()) == 4 * layers  # qkv, o, gate_up, down
    assert types["embed_tokens"] == types["lm_head"] == "Q8_0"
    assert not any(isinstance(m, torch.nn.Linear) for m in llm.engine.model.modules())


def test_quantizing_at_load_tracks_the_exact_model(llm):
    q8 = LLM(quantization="q8_0", dtype="float32", max_num_seqs=8)
    assert set(block_types(q8.engine.model).values()) == {"Q8_0"}
    prompts = [llm.tokenizer.encode(p) for p in PROMPTS]
    params = SamplingParams(max_tokens=1, temperature=0)
    exact, approx = llm.generate(prompts, params), q8.generate(prompts, params)
    assert sum(a.token_ids == b.token_ids for a, b in zip(exact, approx)) >= len(PROMPTS) - 1


def test_none_is_dense():
    dense = LLM(quantization="none", dtype="float32", max_num_seqs=2)
    assert block_types(dense.engine.model) == {}


def test_unknown_mode_is_a_value_error_naming_the_field():
    with pytest.raises(ValueError, match="quantization"):
        EngineConfig(quantization="int3")


def test_other_devices_get_dense_weights():
    """Block kernels are CPU kernels: elsewhere weights are dequantized at load, and asking for load-time
    quantization there is refused rather than silently ignored."""
    weight = torch.randn(4, 64)
    state = {"w": GGMLWeight.quantize(weight, gguf.GGMLQuantizationType.Q8_0), "norm": torch.ones(4)}
    dense = resolve_weights(state, "auto", torch.device("meta"))
    assert isinstance(dense["w"], torch.Tensor) and torch.allclose(dense["w"], weight, atol=0.05)
    with pytest.raises(ValueError, match="quantization"):
        resolve_weights(state, "q4_1", torch.device("meta"))
