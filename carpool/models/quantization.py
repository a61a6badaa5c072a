"""Weights kept in GGML block formats and the modules that compute with them.

A decode step streams every weight once, so the bytes per weight set its floor: GGUF's own 4-bit blocks are a
quarter of bf16. The kernels run Q4_0, Q4_1, Q5_0 and Q8_0 (blocks of 32 weights) and the K-quants Q4_K, Q5_K
and Q6_K (super-blocks of 256) that Q*_K_M files mostly hold. `quantization` picks what a model runs on:
- "auto": tensors the GGUF file stores in a kernel format stay in it (a safetensors model is dense);
- "none": everything dequantized to the engine's dtype (the reference path);
- "q8_0", "q4_1", "q4_0": every 2-D weight (projections, embedding, LM head) quantized at load (gguf-py
  quantizes these; it has no K-quant quantizer).
The block kernels are CPU kernels (`carpool.kernels`); on other devices weights are dequantized at load.
"""

from contextlib import contextmanager
from dataclasses import dataclass

import gguf
import numpy as np
import torch
from torch import nn

from carpool.kernels import kernel_path
from carpool.kernels.isa import INT8_PROMPT_PATHS, OCTET_MAJOR_PATHS, ROW_GROUP_PATHS

# The load-time quantization modes.
GGML_TYPES = {
    "q4_0": gguf.GGMLQuantizationType.Q4_0,
    "q4_1": gguf.GGMLQuantizationType.Q4_1,
    "q8_0": gguf.GGMLQuantizationType.Q8_0,
}
QUANTIZATION_MODES = ("auto", "none", *GGML_TYPES)
# How the block kernels multiply (torch.ops.carpool.set_matmul_mode): "exact" dequantizes every weight and
# dots it with the activations as they are (bit-faithful to gguf-py's values); "int8-dot" quantizes each activation
# row to int8 (per 32 values, or per 256 for K-quants) and runs integer dot products when a call has at most
# int8_dot_max_rows(qtype) rows (decode batches: up to 64, fewer where the exact path is as fast; every row for the
# K-quants on avx512, where the integer kernels stay ahead at prompt sizes; per format and kernel build), what
# llama.cpp does: 2-3x faster at batch 1, 1.2-2x at 16-64 rows, ~1% error per linear. The limit counts a step's rows,
# prompt chunks included: only calls with more rows stay exact.
# "int8-dot-all" runs the integer kernels on every call, prompt chunks too (llama.cpp does at every row count): the
# same ~0.6% error per linear, now in prefill as well; faster prefill where the exact path is fp32 FMAs (AVX2).
MATMUL_MODES = ("exact", "int8-dot", "int8-dot-all")
# The engine's `matmul` setting: a mode, or "auto" (the default), resolved by resolve_matmul.
MATMUL_SETTINGS = ("auto", *MATMUL_MODES)
# Every format torch.ops.carpool.ggml_linear / ggml_dequantize run from a GGUF file's own blocks.
KERNEL_TYPES = frozenset(
    {
        *GGML_TYPES.values(),
        gguf.GGMLQuantizationType.Q5_0,
        gguf.GGMLQuantizationType.Q4_K,
        gguf.GGMLQuantizationType.Q5_K,
        gguf.GGMLQuantizationType.Q6_K,
    }
)


# carpool's arrangements of a GGUF matrix's bytes (Layout in kernels/csrc/ggml_blocks.h), by the flag a qtype the ops
# take carries: "octet-major" Q4_0/Q4_1 rows (each eight blocks' scales together), Q4_K and Q6_K "row-groups" (eight
# rows' blocks word-interleaved). Each is made once at load, where the kernel path's GEMV runs it faster.
LAYOUT_FLAGS = {"gguf": 0, "octet-major": 1 << 8, "row-groups": 1 << 9}
OCTET_MAJOR, ROW_GROUPS = LAYOUT_FLAGS["octet-major"], LAYOUT_FLAGS["row-groups"]
OCTET_MAJOR_TYPES = frozenset({gguf.GGMLQuantizationType.Q4_0, gguf.GGMLQuantizationType.Q4_1})
OCTET_WEIGHTS = 256  # eight blocks of 32: rows narrower than this have no octet to rearrange
ROW_GROUP_TYPES = frozenset({gguf.GGMLQuantizationType.Q4_K, gguf.GGMLQuantizationType.Q6_K})
GROUP_ROWS = 8  # a matrix whose rows are not whole groups stays in GGUF's layout
# The arrangement each format has besides GGUF's.
ARRANGEMENTS = {**dict.fromkeys(OCTET_MAJOR_TYPES, "octet-major"), **dict.fromkeys(ROW_GROUP_TYPES, "row-groups")}
# Bumped whenever an arrangement's bytes, what the loader builds or the layout file's format change
# (carpool.models.layout_cache), so layout files written before are rebuilt, never read.
LAYOUT_VERSION = 1


class BuiltInMemory:
    """Where the loader's built matrices (fused projections, arrangements) go by default: `matrix(name, build)`
    builds each in this process's memory; carpool.models.layout_cache writes them to a file shared by every
    process instead. `build` returns a GGMLWeight, or None where there is nothing to build."""

    def matrix(self, name: str, build):
        return build()


BUILT_IN_MEMORY = BuiltInMemory()


@dataclass
class GGMLWeight:
    """A [rows, cols] weight as GGML blocks along each row: uint8 data of shape [rows, bytes per row], in GGUF's
    layout or one of carpool's arrangements of the same bytes (LAYOUT_FLAGS)."""

    qtype: gguf.GGMLQuantizationType
    data: torch.Tensor
    layout: str = "gguf"

    @property
    def kernel_qtype(self) -> int:
        """The qtype torch.ops.carpool's block ops take for these rows."""
        return int(self.qtype) | LAYOUT_FLAGS[self.layout]

    def for_kernels(self, lookup: bool = False) -> "GGMLWeight":
        """These weights as this CPU's kernel path runs them fastest: Q4_0/Q4_1 octet-major on OCTET_MAJOR_PATHS,
        Q4_K and Q6_K in row groups on ROW_GROUP_PATHS unless the rows are looked up one by one (`lookup`: an
        embedding)."""
        if self.layout != "gguf":
            return self
        path = kernel_path()
        if self.qtype in OCTET_MAJOR_TYPES and self.shape[1] >= OCTET_WEIGHTS and path in OCTET_MAJOR_PATHS:
            return self.arranged("octet-major")
        if self.qtype in ROW_GROUP_TYPES and self.shape[0] % GROUP_ROWS == 0 and not lookup and path in ROW_GROUP_PATHS:
            return self.arranged("row-groups")
        return self

    def arranged(self, layout: str) -> "GGMLWeight":
        """These weights (in GGUF's layout) with their bytes in `layout`, one of ARRANGEMENTS[qtype]'s."""
        make = {"octet-major": torch.ops.carpool.ggml_octet_major, "row-groups": torch.ops.carpool.ggml_row_groups}
        return GGMLWeight(self.qtype, make[layout](self.data, int(self.qtype)), layout)

    def in_gguf_layout(self) -> "GGMLWeight":
        """These weights with their rows as GGUF holds them."""
        if self.layout == "gguf":
            return self
        return GGMLWeight(self.qtype, torch.ops.carpool.ggml_gguf_rows(self.data, self.kernel_qtype))

    @property
    def shape(self) -> tuple[int, int]:
        block_size, block_bytes = gguf.GGML_QUANT_SIZES[self.qtype]
        return self.data.shape[0], self.data.shape[1] // block_bytes * block_size

    def dequantize(self) -> torch.Tensor:
        """fp32 values, as gguf-py computes them: by the C++ kernel (bit-exact, 2-13x faster than gguf-py's numpy,
        which made `--quantization none` take 11 s for Qwen 0.5B) for the formats it runs, else by gguf-py."""
        if self.qtype in KERNEL_TYPES:
            return torch.ops.carpool.ggml_dequantize(self.data.contiguous(), self.kernel_qtype, torch.float32)
        return torch.from_numpy(gguf.quants.dequantize(self.data.numpy(), self.qtype).astype(np.float32))

    @classmethod
    def quantize(cls, weight: torch.Tensor, qtype: gguf.GGMLQuantizationType) -> "GGMLWeight":
        array = weight.detach().float().cpu().numpy()
        return cls(qtype, torch.from_numpy(np.ascontiguousarray(gguf.quants.quantize(array, qtype))))


def resolve_matmul(matmul: str, path: str) -> str:
    """The mode `matmul` (one of MATMUL_SETTINGS) names on kernel path `path`. "auto": "int8-dot-all" on avx2 and
    avxvnni (INT8_PROMPT_PATHS), whose exact path multiplies prompt chunks in fp32 FMAs (no bf16 units; avx2's int8
    kernels 1.5-2.0x faster at 128-512 rows, one thread, docs/benchmarks/journal.md), else "int8-dot": prompts stay exact
    where bf16 units are as fast end to end (avx512's 32-weight formats; its K-quants take every row,
    int8_dot_max_rows), where AMX tiles beat the int8 kernels (amx: batches above 16 rows and prompts run exact) or
    where there is no batched int8 kernel (portable)."""
    if matmul not in MATMUL_SETTINGS:
        raise ValueError(f"matmul must be one of {MATMUL_SETTINGS}, got {matmul!r}")
    if matmul != "auto":
        return matmul
    return "int8-dot-all" if path in INT8_PROMPT_PATHS else "int8-dot"


def set_matmul_mode(matmul: str) -> str:
    """Make the calling thread's block-format linear layers run `matmul` (one of MATMUL_MODES); returns the
    mode it replaces."""
    if matmul not in MATMUL_MODES:
        raise ValueError(f"matmul must be one of {MATMUL_MODES}, got {matmul!r}")
    return MATMUL_MODES[torch.ops.carpool.set_matmul_mode(MATMUL_MODES.index(matmul))]


@contextmanager
def matmul_mode(matmul: str):
    """Run the block `with` in `matmul` on this thread, then restore the thread's mode: an engine step never
    leaves its mode behind for other code on the same thread (a test calling the kernels, another engine)."""
    previous = set_matmul_mode(matmul)
    try:
        yield
    finally:
        set_matmul_mode(previous)


def quantizable(shape, qtype: gguf.GGMLQuantizationType) -> bool:
    """A weight of this shape splits into `qtype` blocks along its rows (32 weights a block, 256 for K-quants)."""
    block_size = gguf.GGML_QUANT_SIZES[qtype][0]
    return len(shape) == 2 and shape[1] % block_size == 0


def concat_rows(weights: list) -> "torch.Tensor | GGMLWeight":
    """Stack weights along their output rows (fused q/k/v, gate/up); blocks stay blocks when all share a type."""
    if all(isinstance(w, GGMLWeight) for w in weights) and len({w.kernel_qtype for w in weights}) == 1:
        return GGMLWeight(weights[0].qtype, torch.cat([w.data for w in weights]), weights[0].layout)
    return torch.cat([w.dequantize() if isinstance(w, GGMLWeight) else w for w in weights])


def first_dense_linear(model: nn.Module) -> str | None:
    """The name of the model's first linear layer held in dense floats (torch's matmul), None when every one is in
    a block format (GGMLLinear)."""
    return next((name for name, module in model.named_modules() if isinstance(module, nn.Linear)), None)


class GGMLLinear(nn.Module):
    """y = x W^T with W in GGML blocks; float32 or bfloat16 activations, output in the input's dtype."""

    def __init__(self, weight: GGMLWeight):
        super().__init__()
        self.ggml_type, self.layout = weight.qtype, weight.layout
        self.qtype = weight.kernel_qtype
        self.out_features, self.in_features = weight.shape
        self.register_buffer("qweight", weight.data, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.carpool.ggml_linear(x, self.qweight, self.qtype)

    def rows(self, ids: torch.Tensor) -> "GGMLLinear":
        """A linear computing only the outputs `ids`, in their order: a copy of those weight rows, laid out anew."""
        rows = GGMLWeight(self.ggml_type, self.qweight, self.layout).in_gguf_layout().data.index_select(0, ids)
        return GGMLLinear(GGMLWeight(self.ggml_type, rows).for_kernels())

    def extra_repr(self) -> str:
        layout = f", {self.layout}" if self.layout != "gguf" else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, qtype={self.ggml_type.name}{layout}"


class GGMLEmbedding(nn.Module):
    """Embedding lookup that dequantizes only the rows asked for."""

    def __init__(self, weight: GGMLWeight, dtype: torch.dtype):
        super().__init__()
        self.ggml_type, self.qtype = weight.qtype, weight.kernel_qtype
        self.dtype = dtype
        self.register_buffer("qweight", weight.data, persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.qweight.index_select(0, ids.reshape(-1))
        return torch.ops.carpool.ggml_dequantize(rows, self.qtype, self.dtype).view(*ids.shape, -1)


def check_quantization(quantization: str, field: str = "quantization", device: torch.device | None = None) -> None:
    """ValueError naming `field` (the setting it came from) unless `quantization` is a mode (that `device`, when
    given, runs)."""
    if quantization not in QUANTIZATION_MODES:
        raise ValueError(f"{field} must be one of {QUANTIZATION_MODES}, got {quantization!r}")
    if device is not None and device.type != "cpu" and quantization in GGML_TYPES:
        raise ValueError(f"{field}: {quantization} runs on CPU kernels; on {device.type} use 'auto' or 'none'")


def resolve_weights(state: dict, quantization: str, device: torch.device) -> dict:
    """Apply the `quantization` mode to a loaded state dict (values: dense tensors or GGMLWeights)."""
    check_quantization(quantization, device=device)
    if quantization == "none" or device.type != "cpu":
        return {k: v.dequantize() if isinstance(v, GGMLWeight) else v for k, v in state.items()}
    if quantization in GGML_TYPES:
        qtype = GGML_TYPES[quantization]
        return {
            k: GGMLWeight.quantize(v.dequantize() if isinstance(v, GGMLWeight) else v, qtype)
            if isinstance(v, GGMLWeight) or quantizable(v.shape, qtype)
            else v
            for k, v in state.items()
        }
    return state


def install_ggml_modules(model: nn.Module, state: dict, dtype: torch.dtype, layouts=BUILT_IN_MEMORY) -> dict:
    """Swap the Linear/Embedding modules whose weights are GGMLWeights (in the layout this CPU's kernels run
    fastest, built by `layouts`: see BuiltInMemory) for block-format modules; returns the dense rest of the state
    dict, for load_state_dict."""
    dense, laid_out = {}, {}  # a tied embedding and LM head: one GGMLWeight, rearranged once and shared
    modules = {
        name: model.get_submodule(name.removesuffix(".weight"))
        for name, value in state.items()
        if isinstance(value, GGMLWeight)
    }
    looked_up = {id(state[name]) for name, module in modules.items() if isinstance(module, nn.Embedding)}
    for name, value in state.items():
        if not isinstance(value, GGMLWeight):
            dense[name] = value
            continue
        if id(value) not in laid_out:
            laid_out[id(value)] = layouts.matrix(name, lambda v=value: _rearranged(v, id(v) in looked_up)) or value
        value = laid_out[id(value)]
        module_name = name.removesuffix(".weight")
        module = modules[name]
        if isinstance(module, nn.Embedding):
            replacement = GGMLEmbedding(value, dtype)
        elif isinstance(module, nn.Linear) and module.bias is None:
            replacement = GGMLLinear(value)
        else:
            raise ValueError(f"model: {name} is in GGML blocks but {type(module).__name__} cannot use them")
        if replacement_shape(module) != value.shape:
            raise ValueError(f"model: {name} has shape {value.shape}, expected {replacement_shape(module)}")
        model.set_submodule(module_name, replacement)
    return dense


def _rearranged(weight: GGMLWeight, lookup: bool) -> GGMLWeight | None:
    """`weight` as the kernels run it, or None where that is the weight as it is."""
    arranged = weight.for_kernels(lookup)
    return None if arranged is weight else arranged


def replacement_shape(module: nn.Module) -> tuple[int, int]:
    if isinstance(module, nn.Embedding):
        return module.num_embeddings, module.embedding_dim
    return module.out_features, module.in_features
