"""The Llama family (Llama 2/3, SmolLM, TinyLlama...): RMSNorm, RoPE, grouped-query attention, SwiGLU.

`model(input_ids, positions)` returns hidden states for every token; `compute_logits` projects only the rows
that will be sampled. Attention reads and writes the paged KV cache through `PagedAttention`.
On the CPU the element-wise steps (RMSNorm, rotary, SwiGLU) run as fused kernels (`torch.ops.carpool`); each
module's `forward_native` is the torch version, used on other devices and as the kernels' reference.
"""

import torch
import torch.nn.functional as F
from torch import nn

import carpool.kernels  # noqa: F401  (registers torch.ops.carpool)
from carpool.engine.attention import PagedAttention
from carpool.models.loader import ModelConfig
from carpool.models.quantization import concat_rows, install_ggml_modules


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
    def __init__(self, head_dim: int, max_positions: int, theta: float):
        super().__init__()
        # Built on the CPU even when the model is constructed on the meta device (weights arrive later).
        cpu = torch.device("cpu")
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=cpu) / head_dim))
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32, device=cpu), inv_freq)
        angles = torch.cat([freqs, freqs], dim=-1)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

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


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, rotary: RotaryEmbedding):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        # q, k and v share one matmul: one pass over the activations instead of three.
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=False)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=False)
        self.rotary = rotary
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, self.head_dim)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self.rotary(positions, q.view(-1, self.num_heads, self.head_dim), k.view(-1, self.num_kv_heads, self.head_dim))
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        return self.o_proj(self.attn(q, k, v))


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if gate_up.device.type == "cpu":
            return self.down_proj(torch.ops.carpool.silu_mul(gate_up))
        return self.down_proj(self.silu_mul_native(gate_up))

    def silu_mul_native(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return F.silu(gate) * up


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, rotary: RotaryEmbedding):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, rotary)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = LlamaMLP(config)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(positions, self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        rotary = RotaryEmbedding(config.head_dim, config.max_position_embeddings, config.rope_theta)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, rotary) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            x = layer(positions, x)
        return self.norm(x)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def load_hf_weights(self, state: dict, dtype: torch.dtype) -> None:
        """Load a state dict with Hugging Face names, fusing q/k/v and gate/up as this module stores them.
        Weights in GGML blocks replace their Linear/Embedding with the block-format module."""
        own = {name.removeprefix("model."): tensor for name, tensor in state.items()}
        for i in range(self.config.num_layers):
            prefix = f"layers.{i}."
            attn, mlp = prefix + "self_attn.", prefix + "mlp."
            own[attn + "qkv_proj.weight"] = concat_rows(
                [own.pop(attn + "q_proj.weight"), own.pop(attn + "k_proj.weight"), own.pop(attn + "v_proj.weight")]
            )
            own[mlp + "gate_up_proj.weight"] = concat_rows([own.pop(mlp + "gate_proj.weight"), own.pop(mlp + "up_proj.weight")])
        if self.config.tie_word_embeddings:
            own.pop("lm_head.weight", None)
            own["lm_head.weight"] = own["embed_tokens.weight"]
        own = install_ggml_modules(self, own, dtype)
        missing, unexpected = self.load_state_dict(own, strict=False, assign=True)
        missing = [m for m in missing if not m.endswith(("rotary.cos", "rotary.sin"))]
        if missing or unexpected:
            raise ValueError(f"model: weights do not match the architecture (missing {missing}, unexpected {unexpected})")
