"""Weights in GGML blocks: which modules get them, and that the model still computes the same function."""

import gguf
import numpy as np
import pytest
import torch
from test_reference import PROMPTS

from carpool import LLM, SamplingParams
from carpool.engine.config import EngineConfig
from carpool.kernels import kernel_path
from carpool.kernels.isa import OCTET_MAJOR_PATHS
from carpool.models import quantization
from carpool.models.quantization import (
    KERNEL_TYPES,
    GGMLEmbedding,
    GGMLLinear,
    GGMLWeight,
    install_ggml_modules,
    quantizable,
    resolve_weights,
)


def block_types(model) -> dict[str, str]:
    return {
        name: module.ggml_type.name
        for name, module in model.named_modules()
        if isinstance(module, (GGMLLinear, GGMLEmbedding))
    }


def test_auto_keeps_the_gguf_files_own_blocks(llm):
    """SmolLM2's GGUF stores the projections in Q4_1 and the tied embedding in Q8_0: they stay so, fused."""
    types = block_types(llm.engine.model)
    layers = llm.engine.model_config.num_layers
    assert sum(t == "Q4_1" for t in types.values()) == 4 * layers  # qkv, o, gate_up, down
    q4_1 = [m for m in llm.engine.model.modules() if isinstance(m, GGMLLinear) and m.ggml_type.name == "Q4_1"]
    # rearranged where that gains
    assert {m.layout for m in q4_1} == {"octet-major" if kernel_path() in OCTET_MAJOR_PATHS else "gguf"}
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


def random_blocks(rows: int, cols: int, qtype) -> GGMLWeight:
    """Random quantized values and sub-scales (gguf-py has no K-quant quantizer); f16 scales of 1e-3 keep the
    weights finite and of order 1."""
    block_size, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    blocks = np.random.default_rng(0).integers(0, 256, (rows, cols // block_size, block_bytes), dtype=np.uint8)
    Q = gguf.GGMLQuantizationType
    for offset in {Q.Q6_K: (208,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2)}.get(qtype, (0,)):  # d (and K-quants' dmin)
        blocks[..., offset : offset + 2] = (
            np.full(blocks.shape[:2], 1e-3, np.float16).view(np.uint8).reshape(rows, -1, 2)
        )
    return GGMLWeight(qtype, torch.from_numpy(blocks.reshape(rows, -1)))


def test_quantizable_follows_each_formats_block_size():
    q4_0, q4_k = gguf.GGMLQuantizationType.Q4_0, gguf.GGMLQuantizationType.Q4_K
    assert quantizable((4, 288), q4_0) and not quantizable((4, 288), q4_k)  # 32-weight blocks, 256-weight ones
    assert quantizable((4, 512), q4_k)
    assert not quantizable((512,), q4_0)


@pytest.mark.parametrize("qtype", ["Q4_K", "Q5_K", "Q6_K", "Q5_0"])
def test_q_k_m_file_types_run_on_the_kernels(qtype):
    """The types Q*_K_M GGUF files store stay in blocks under "auto" and the modules compute their weights."""
    qtype = gguf.GGMLQuantizationType[qtype]
    assert qtype in KERNEL_TYPES
    weight = random_blocks(24, 512, qtype)
    model = torch.nn.ModuleDict({"proj": torch.nn.Linear(512, 24, bias=False), "embed": torch.nn.Embedding(24, 512)})
    state = resolve_weights({"proj.weight": weight, "embed.weight": weight}, "auto", torch.device("cpu"))
    assert install_ggml_modules(model, state, torch.float32) == {}
    dense = torch.from_numpy(gguf.quants.dequantize(weight.data.numpy(), qtype).astype(np.float32))
    assert torch.equal(weight.dequantize(), dense)  # the kernel's dequantization, bit for bit gguf-py's
    x = torch.randn(3, 512)
    torch.testing.assert_close(model["proj"](x), x @ dense.T, rtol=1e-5, atol=1e-4)
    assert torch.equal(model["embed"](torch.tensor([[5, 0]])), dense[[5, 0]].unsqueeze(0))


@pytest.mark.parametrize("gains", (True, False), ids=("octet-major path", "other paths"))
def test_q4_rows_are_laid_out_for_the_path_once_for_a_tied_head(monkeypatch, gains):
    """On OCTET_MAJOR_PATHS the loader rearranges Q4_0/Q4_1 rows octet-major: one copy for a tied embedding and LM
    head, rows narrower than an octet left as they are; the modules' outputs stay the GGUF rows' own."""
    monkeypatch.setattr(quantization, "OCTET_MAJOR_PATHS", {kernel_path()} if gains else set())
    q4_1 = gguf.GGMLQuantizationType.Q4_1
    tied, narrow = GGMLWeight.quantize(torch.randn(24, 512), q4_1), GGMLWeight.quantize(torch.randn(8, 64), q4_1)
    model = torch.nn.ModuleDict(
        {
            "head": torch.nn.Linear(512, 24, bias=False),
            "embed": torch.nn.Embedding(24, 512),
            "small": torch.nn.Linear(64, 8, bias=False),
        }
    )
    install_ggml_modules(model, {"head.weight": tied, "embed.weight": tied, "small.weight": narrow}, torch.float32)
    head, embed, small = model["head"], model["embed"], model["small"]
    assert head.layout == ("octet-major" if gains else "gguf") and head.qweight is embed.qweight
    assert small.layout == "gguf"
    assert torch.equal(head.qweight, tied.data) != gains
    x, ids = torch.randn(3, 512), torch.tensor([7, 0, 23])
    assert torch.equal(head(x), torch.ops.carpool.ggml_linear(x, tied.data, int(q4_1)))
    assert torch.equal(embed(ids), tied.dequantize()[ids])
    # The speculative draft's head keeps a subset of the rows, in the same layout.
    assert torch.equal(head.rows(ids)(x), head(x)[:, ids])


def random_k_quant(rows: int, cols: int, seed: int = 0, qtype=gguf.GGMLQuantizationType.Q4_K) -> GGMLWeight:
    """Q4_K or Q6_K blocks of random bits, their f16 scales (Q4_K's d and dmin, Q6_K's d) small and finite."""
    rng = np.random.default_rng(seed)
    halves = {gguf.GGMLQuantizationType.Q4_K: slice(0, 4), gguf.GGMLQuantizationType.Q6_K: slice(208, 210)}[qtype]
    blocks = rng.integers(0, 256, (rows, cols // 256, gguf.GGML_QUANT_SIZES[qtype][1]), dtype=np.uint8)
    scales = rng.uniform(0.01, 0.02, (rows, cols // 256, (halves.stop - halves.start) // 2)).astype(np.float16)
    blocks[..., halves] = scales.view(np.uint8)
    return GGMLWeight(qtype, torch.from_numpy(blocks.reshape(rows, -1)))


@pytest.mark.parametrize("gains", (True, False), ids=("row-group path", "other paths"))
def test_k_quant_matrices_go_in_row_groups_on_the_path_but_not_an_embeddings(monkeypatch, gains):
    """On ROW_GROUP_PATHS the loader puts Q4_K and Q6_K matrices of whole groups of eight rows in row groups; an
    embedding (and the LM head tied to it) keeps GGUF's rows, which it looks up one by one. Outputs stay the GGUF
    rows' own."""
    monkeypatch.setattr(quantization, "ROW_GROUP_PATHS", {kernel_path()} if gains else set())
    proj, odd, tied = random_k_quant(24, 512), random_k_quant(12, 256, seed=1), random_k_quant(16, 256, seed=2)
    down = random_k_quant(16, 512, seed=3, qtype=gguf.GGMLQuantizationType.Q6_K)
    model = torch.nn.ModuleDict(
        {
            "proj": torch.nn.Linear(512, 24, bias=False),
            "odd": torch.nn.Linear(256, 12, bias=False),
            "down": torch.nn.Linear(512, 16, bias=False),
            "head": torch.nn.Linear(256, 16, bias=False),
            "embed": torch.nn.Embedding(16, 256),
        }
    )
    state = {"proj.weight": proj, "odd.weight": odd, "down.weight": down, "head.weight": tied, "embed.weight": tied}
    install_ggml_modules(model, state, torch.float32)
    assert model["proj"].layout == model["down"].layout == ("row-groups" if gains else "gguf")
    assert model["odd"].layout == "gguf"  # 12 rows: not whole groups
    assert model["head"].layout == "gguf" and model["head"].qweight is model["embed"].qweight
    x = torch.randn(3, 512)
    assert torch.equal(model["proj"](x), torch.ops.carpool.ggml_linear(x, proj.data, int(proj.qtype)))
    assert torch.equal(model["down"](x), torch.ops.carpool.ggml_linear(x, down.data, int(down.qtype)))
    assert torch.equal(model["embed"](torch.tensor([3, 15])), tied.dequantize()[[3, 15]])
    # A subset of the rows (a draft model's head) is laid out anew: four rows stay GGUF's, eight go in a group.
    four, eight = torch.tensor([7, 0, 23, 8]), torch.arange(16, 0, -2)
    assert model["proj"].rows(four).layout == "gguf"
    assert model["proj"].rows(eight).layout == model["proj"].layout
    for ids in (four, eight):
        assert torch.equal(model["proj"].rows(ids)(x), model["proj"](x)[:, ids])
