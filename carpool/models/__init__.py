"""Model architectures and weight loading. A new architecture is one file plus one line in MODEL_CLASSES."""

from pathlib import Path

import torch

from carpool.models.llama import LlamaForCausalLM
from carpool.models.loader import ModelConfig, load_weights, resolve_model_dir
from carpool.models.tokenizer import Tokenizer

MODEL_CLASSES = {"LlamaForCausalLM": LlamaForCausalLM}


def load_model(path: str | None, device: str = "cpu", dtype: torch.dtype = torch.float32, quantization: str = "none"):
    """(model, tokenizer, config) for a GGUF file, a safetensors directory, or the default model when None.
    Activations run in `dtype`, and weights too unless `quantization` keeps them in GGML blocks
    (carpool.models.quantization); RMSNorm statistics and logits are computed in fp32."""
    directory: Path = resolve_model_dir(path)
    config, state = load_weights(directory, quantization, torch.device(device))
    model_class = MODEL_CLASSES.get(config.architecture)
    if model_class is None:
        raise ValueError(f"model: unsupported architecture {config.architecture!r}")
    with torch.device("meta"):  # no random init: every weight is assigned from the file
        model = model_class(config)
    model.load_hf_weights(state, dtype)
    model = model.eval().to(device=device, dtype=dtype)
    return model, Tokenizer.from_dir(directory), config


__all__ = ["MODEL_CLASSES", "ModelConfig", "Tokenizer", "load_model"]
