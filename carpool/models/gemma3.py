"""Gemma 3 (text): Llama's skeleton with
- RMSNorm scaling by (1 + weight), and four norms per layer: before and after attention and the MLP;
- RMSNorm on each query and key head, attention scaled by query_pre_attn_scalar ** -0.5;
- GeGLU (tanh-approximated GELU) instead of SwiGLU, embeddings multiplied by sqrt(hidden_size);
- sliding-window layers (local rope base) interleaved with global ones (config.layer_types).
"""

from typing import ClassVar

import torch
from torch import nn

from carpool.models.config import ModelConfig
from carpool.models.layers import CausalLM, GatedMLP, QKVAttention, RMSNorm, RotaryEmbedding


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int, rotary: RotaryEmbedding):
        super().__init__()
        size, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = RMSNorm(size, eps)
        self.self_attn = QKVAttention(config, layer, rotary, qk_norm=True)
        self.post_attention_layernorm = RMSNorm(size, eps)
        self.pre_feedforward_layernorm = RMSNorm(size, eps)
        self.mlp = GatedMLP(config, activation="gelu_tanh")
        self.post_feedforward_layernorm = RMSNorm(size, eps)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        x = x + self.post_attention_layernorm(self.self_attn(positions, self.input_layernorm(x)))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))

    def fused_norms(self) -> tuple[RMSNorm, RMSNorm, RMSNorm, RMSNorm]:
        """Before attention, on its output, before the MLP, on its output (see DecoderLayer.fused_norms)."""
        attention = self.input_layernorm, self.post_attention_layernorm
        return *attention, self.pre_feedforward_layernorm, self.post_feedforward_layernorm


class Gemma3ForCausalLM(CausalLM):
    gguf_architecture = "gemma3"
    layer_class = Gemma3DecoderLayer
    gguf_layer_names: ClassVar[dict[str, str]] = {
        "ffn_norm": "pre_feedforward_layernorm",
        "post_attention_norm": "post_attention_layernorm",
        "post_ffw_norm": "post_feedforward_layernorm",
        "attn_q_norm": "self_attn.q_norm",
        "attn_k_norm": "self_attn.k_norm",
    }
    norm_offset = 1.0
    embedding_scaled = True
