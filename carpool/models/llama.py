"""The Llama family (Llama 2/3, SmolLM, TinyLlama...): RMSNorm, RoPE, grouped-query attention, SwiGLU."""

from carpool.models.layers import CausalLM


class LlamaForCausalLM(CausalLM):
    gguf_architecture = "llama"
    gguf_rope_permuted = True
