"""The layers every architecture composes: RMSNorm, rotary embedding, the paged q/k/v attention block, gated
MLPs, linears fused over several projections, and the decoder-only causal LM skeleton with its weight loader.

`model(input_ids, positions)` returns hidden states for every token; `compute_logits` projects only the rows
that will be sampled. Attention reads and writes the paged KV cache through `PagedAttention`.
On the CPU the element-wise steps (RMSNorm, rotary, SwiGLU) run as fused kernels (`torch.ops.carpool`); each
module's `forward_native` is the torch version, used on other devices and as the kernels' reference.
A step of decodes only runs every decoder layer as one C++ call instead (`CausalLM.decode_stack`, the same
kernels in the same order); the modules' forward stays its reference and runs prefill and mixed steps.
Weights arrive as a state dict with Hugging Face names and values (carpool.models.loader); an architecture
class says how its GGUF file names and stores them differently.
"""

import itertools
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

import carpool.kernels  # noqa: F401  (registers torch.ops.carpool)
from carpool.models.attention import AttentionMetadata, PagedAttention, decode_only_metadata
from carpool.models.config import ModelConfig
from carpool.models.quantization import (
    BUILT_IN_MEMORY,
    GGMLLinear,
    GGMLWeight,
    concat_rows,
    install_ggml_modules,
)

# Rotary tables start this long and double when a position needs more, so a 32K-context model does not hold
# 32K rows of cos/sin per rope base (64 MiB for Gemma 3's head_dim 256 in fp32) to serve short requests.
ROTARY_INITIAL_POSITIONS = 4096


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type == "cpu":
            return torch.ops.carpool.rms_norm(x, self.weight, self.eps)
        return self.forward_native(x)

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        # The statistics in fp32 whatever the model's dtype: bf16 sums of squares lose too much.
        wide = x.float()
        return (wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling_factor: float = 1.0):
        super().__init__()
        self.max_positions = max_positions
        # Built on the CPU even when the model is constructed on the meta device (weights arrive later).
        cpu = torch.device("cpu")
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=cpu) / head_dim))
        self.register_buffer("inv_freq", inv_freq / scaling_factor, persistent=False)  # linear scaling
        cos, sin = self._tables(min(max_positions, ROTARY_INITIAL_POSITIONS))
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def _tables(self, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = torch.outer(
            torch.arange(length, dtype=torch.float32, device=self.inv_freq.device), self.inv_freq.float()
        )
        angles = torch.cat([freqs, freqs], dim=-1)
        return angles.cos(), angles.sin()

    def reserve(self, positions: int) -> None:
        """Make the tables cover positions [0, positions) (at least; they grow by doubling)."""
        if positions <= self.cos.shape[0]:
            return
        cos, sin = self._tables(max(positions, min(2 * self.cos.shape[0], self.max_positions)))
        self.cos, self.sin = cos.to(self.cos), sin.to(self.sin)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [T, heads, head_dim], k: [T, kv_heads, head_dim], rotated by each token's position (half-split
        layout, as in HF). The CPU kernel rotates them in place."""
        if q.device.type == "cpu":
            torch.ops.carpool.rotary_embedding(positions, q, k, self.cos, self.sin)
            return q, k
        return self.forward_native(positions, q), self.forward_native(positions, k)

    def forward_native(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        cos = self.cos[positions].unsqueeze(1)
        sin = self.sin[positions].unsqueeze(1)
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos + rotated * sin


class FusedLinear(nn.Module):
    """Several projections of one input (q/k/v, gate/up) as one matmul: one pass over the activations instead
    of several. Projections whose GGUF blocks differ in type (Qwen2.5-0.5B's q/k are Q5_0 and its v Q8_0) cannot
    share one block matrix; each run of equal types stays one part, and the parts fill the output side by side.
    The bias (Qwen2's q/k/v) is added after the matmul, so block-format parts can have one."""

    def __init__(self, in_features: int, out_sizes: list[int], bias: bool):
        super().__init__()
        self.in_features = in_features
        self.parts = nn.ModuleList([nn.Linear(in_features, sum(out_sizes), bias=False)])
        self.bias = nn.Parameter(torch.zeros(sum(out_sizes))) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if len(self.parts) == 1 and isinstance(self.parts[0], nn.Linear):
            return F.linear(x, self.parts[0].weight, self.bias)  # one dense matrix: Hugging Face's own op
        out = self.parts[0](x) if len(self.parts) == 1 else torch.cat([part(x) for part in self.parts], dim=-1)
        return out if self.bias is None else out + self.bias

    def fuse(self, prefix: str, weights: list, biases: list | None, layouts=BUILT_IN_MEMORY) -> dict:
        """State dict entries (under `prefix`) for the projections' weights and biases, in output order; makes
        one part per run of weights that can be stacked (block matrices built, as the kernels run them, by
        `layouts`: see quantization.BuiltInMemory)."""
        # Runs of one block type stack into one matrix; dense tensors (no qtype) stack with each other.
        runs = [list(run) for _, run in itertools.groupby(weights, key=lambda w: getattr(w, "qtype", None))]
        stacked = [_stacked(f"{prefix}parts.{i}.weight", run, layouts) for i, run in enumerate(runs)]
        device = self.parts[0].weight.device
        self.parts = nn.ModuleList(nn.Linear(self.in_features, w.shape[0], bias=False, device=device) for w in stacked)
        state = {f"{prefix}parts.{i}.weight": w for i, w in enumerate(stacked)}
        if biases is not None:
            state[f"{prefix}bias"] = torch.cat(biases)
        return state


def _stacked(name: str, run: list, layouts):
    if len(run) == 1:
        return run[0]
    if isinstance(run[0], GGMLWeight):
        return layouts.matrix(name, lambda: concat_rows(run).for_kernels())
    return concat_rows(run)


def projection_parts(module: nn.Module) -> tuple[list[torch.Tensor], list[int]]:
    """A linear (nn.Linear, GGMLLinear or FusedLinear) as the fused decode step takes it: its weight parts in
    output order, GGML blocks with their qtype and dense matrices with -1."""
    modules = module.parts if isinstance(module, FusedLinear) else [module]
    weights = [m.qweight if isinstance(m, GGMLLinear) else m.weight for m in modules]
    return weights, [m.qtype if isinstance(m, GGMLLinear) else -1 for m in modules]


class QKVAttention(nn.Module):
    """Grouped-query attention over the paged KV cache; optionally RMSNorm on each query and key head (Gemma 3)."""

    def __init__(self, config: ModelConfig, layer: int, rotary: RotaryEmbedding, qk_norm: bool = False):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = FusedLinear(
            config.hidden_size, [self.q_size, self.kv_size, self.kv_size], config.attention_bias
        )
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if qk_norm else None
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=False)
        self.rotary = rotary
        self.attn = PagedAttention(
            self.num_heads, self.num_kv_heads, self.head_dim, config.attention_scale, config.layer_window(layer)
        )

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(positions, q, k)
        return self.o_proj(self.attn(q, k, v.view(-1, self.num_kv_heads, self.head_dim)))


_GATE_ACTIVATIONS = {
    "silu": F.silu,  # SwiGLU
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),  # GeGLU, as Gemma's gelu_pytorch_tanh
}


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)) with gate and up fused into one matmul."""

    def __init__(self, config: ModelConfig, activation: str = "silu"):
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.activation = activation
        self.gate_up_proj = FusedLinear(config.hidden_size, [config.intermediate_size] * 2, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if gate_up.device.type == "cpu" and self.activation == "silu":
            return self.down_proj(torch.ops.carpool.silu_mul(gate_up))
        return self.down_proj(self.act_mul_native(gate_up))

    def act_mul_native(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return _GATE_ACTIVATIONS[self.activation](gate) * up


class DecoderLayer(nn.Module):
    """Pre-norm residual block (Llama, Qwen2): x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, config: ModelConfig, layer: int, rotary: RotaryEmbedding):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = QKVAttention(config, layer, rotary)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = GatedMLP(config)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(positions, self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))

    def fused_norms(self) -> tuple[RMSNorm, RMSNorm | None, RMSNorm, RMSNorm | None]:
        """The norms as the fused decode step places them: before attention, on its output, before the MLP, on
        its output (Llama has no output norms)."""
        return self.input_layernorm, None, self.post_attention_layernorm, None


class CausalLM(nn.Module):
    """Embedding, decoder layers, final norm, LM head. Subclasses set what differs in their architecture."""

    gguf_architecture: str  # GGUF's general.architecture
    layer_class = DecoderLayer
    # GGUF tensor names (after `blk.N.`) that this architecture maps differently from carpool.models.loader's.
    gguf_layer_names: ClassVar[dict[str, str]] = {}
    # llama.cpp's converter interleaves each head's q/k rows for its rotary layout (Llama only); undone at load.
    gguf_rope_permuted = False
    # Gemma's RMSNorm scales by (1 + weight): Hugging Face stores the weight, GGUF the sum.
    norm_offset = 0.0
    embedding_scaled = False  # Gemma multiplies embeddings by sqrt(hidden_size)

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        # Decode-only CPU steps run every layer in one C++ call (carpool/kernels/csrc/decode_layer.cpp) with the
        # same kernels as the layers' forward, which stays the reference; False runs the layers one by one.
        self.fused_decode = True
        self._decode_stack = None  # (what it was built from, the stack): rebuilt when the weights or caches change

        def rotary(layer_type: str) -> RotaryEmbedding:
            local = layer_type != "full_attention"
            theta = config.rope_local_theta if local else config.rope_theta
            factor = 1.0 if local else config.rope_scaling_factor
            return RotaryEmbedding(config.head_dim, config.max_position_embeddings, theta, factor)

        self.rotaries = nn.ModuleDict({t: rotary(t) for t in dict.fromkeys(config.layer_types)})
        # An uninitialized table: nn.Embedding's own init (normal_) imports torch._dynamo, 3 s of start-up.
        self.embed_tokens = nn.Embedding(
            config.vocab_size, config.hidden_size, _weight=torch.empty(config.vocab_size, config.hidden_size)
        )
        self.layers = nn.ModuleList(
            self.layer_class(config, i, self.rotaries[t]) for i, t in enumerate(config.layer_types)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        last = int(positions.max()) + 1
        for rotary in self.rotaries.values():
            rotary.reserve(last)
        x = self.embed_tokens(input_ids)
        if self.embedding_scaled:  # in the activations' dtype, as Hugging Face rounds it
            x = x * x.new_tensor(self.config.hidden_size**0.5)
        fused = self.fused_decode and x.device.type == "cpu" and hasattr(self.layer_class, "fused_norms")
        meta = decode_only_metadata(input_ids.numel()) if fused else None
        if meta is not None:
            x = self._fused_decode(positions, x, meta)
        else:
            for layer in self.layers:
                x = layer(positions, x)
        return self.norm(x)

    def _fused_decode(self, positions: torch.Tensor, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        rotaries = list(self.rotaries.values())
        group, sliding = meta.decode_groups[0], meta.sliding
        sliding_group = sliding.decode_groups[0] if sliding is not None else None
        return self.decode_stack().forward(
            x,
            positions,
            [r.cos for r in rotaries],
            [r.sin for r in rotaries],
            meta.slot_mapping,
            group.block_tables,
            group.context_lens,
            None if sliding is None else sliding.slot_mapping,
            None if sliding is None else sliding_group.block_tables,
            None if sliding is None else sliding_group.context_lens,
        )

    def decode_stack(self):
        """The layers' weights and KV cache views gathered once into a `torch.classes.carpool.DecodeStack`."""
        first = self.layers[0]
        source = (first.self_attn.attn.k_cache, first.input_layernorm.weight, first.mlp.down_proj)
        if self._decode_stack is not None and all(a is b for a, b in zip(source, self._decode_stack[0])):
            return self._decode_stack[1]
        config, rotaries = self.config, list(self.rotaries.values())
        attn = first.self_attn.attn
        stack = torch.classes.carpool.DecodeStack(
            config.num_heads,
            config.num_kv_heads,
            config.head_dim,
            config.rms_norm_eps,
            attn.scale,
            first.mlp.activation,
        )
        for layer in self.layers:
            attention = layer.self_attn
            norms = [None if norm is None else norm.weight for norm in layer.fused_norms()]
            q_norm, k_norm = attention.q_norm, attention.k_norm
            stack.add_layer(
                *norms,
                None if q_norm is None else q_norm.weight,
                None if k_norm is None else k_norm.weight,
                *projection_parts(attention.qkv_proj),
                attention.qkv_proj.bias,
                *projection_parts(attention.o_proj),
                *projection_parts(layer.mlp.gate_up_proj),
                *projection_parts(layer.mlp.down_proj),
                attention.attn.k_cache,
                attention.attn.v_cache,
                next(i for i, r in enumerate(rotaries) if r is attention.rotary),
                attention.attn.window,
            )
        self._decode_stack = (source, stack)
        return stack

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The rows' logits in the head's output dtype: the sampler widens only the rows that need fp32 (greedy
        rows take their argmax from bf16 as it is). Widening the 1.5B's 32 x 151,936 took 0.2-0.6 ms at 2 threads
        (`python -m carpool.bench.greedy`); its 32-sequence step 214.1 -> 213.3 ms without it (Zen 4, medians of 60,
        alternating in one process)."""
        return self.lm_head(hidden)

    def load_hf_weights(self, state: dict, dtype: torch.dtype, layouts=BUILT_IN_MEMORY) -> None:
        """Load a state dict with Hugging Face names and values, fusing q/k/v and gate/up as this module stores
        them. Weights in GGML blocks replace their Linear/Embedding with the block-format module; the block
        matrices the load builds (fused, rearranged) come from `layouts` (quantization.BuiltInMemory)."""
        own = {name.removeprefix("model."): tensor for name, tensor in state.items()}
        if self.norm_offset:
            own = {k: v + self.norm_offset if k.endswith("norm.weight") else v for k, v in own.items()}
        for i, layer in enumerate(self.layers):
            attn, mlp = f"layers.{i}.self_attn.", f"layers.{i}.mlp."
            projections = [attn + p for p in ("q_proj.", "k_proj.", "v_proj.")]
            weights = [own.pop(p + "weight") for p in projections]
            biases = [own.pop(p + "bias") for p in projections] if self.config.attention_bias else None
            own |= layer.self_attn.qkv_proj.fuse(attn + "qkv_proj.", weights, biases, layouts)
            gate_up = [own.pop(mlp + "gate_proj.weight"), own.pop(mlp + "up_proj.weight")]
            own |= layer.mlp.gate_up_proj.fuse(mlp + "gate_up_proj.", gate_up, None, layouts)
        if self.config.tie_word_embeddings:
            own["lm_head.weight"] = own["embed_tokens.weight"]
        own = install_ggml_modules(self, own, dtype, layouts)
        missing, unexpected = self.load_state_dict(own, strict=False, assign=True)
        if missing or unexpected:
            raise ValueError(
                f"model: weights do not match the architecture (missing {missing}, unexpected {unexpected})"
            )
        if self.config.tie_word_embeddings and isinstance(self.lm_head, nn.Linear):
            self.lm_head.weight = self.embed_tokens.weight  # one Parameter, so a dtype conversion keeps one copy
