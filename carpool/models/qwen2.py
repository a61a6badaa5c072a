"""Qwen2 / Qwen2.5: Llama's layers with a bias on the q/k/v projections (config.attention_bias), a tied or
untied LM head. llama.cpp's converter leaves Qwen2's q/k rows in Hugging Face's order (it permutes only Llama's)."""

from carpool.models.layers import CausalLM


class Qwen2ForCausalLM(CausalLM):
    gguf_architecture = "qwen2"
