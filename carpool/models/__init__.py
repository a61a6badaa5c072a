"""Model architectures and weight loading. A new architecture is one file plus one entry in
carpool.models.registry."""

import torch

from carpool.models.config import ModelConfig
from carpool.models.loader import open_weights, resolve_model_dir
from carpool.models.registry import MODEL_CLASSES, model_class
from carpool.models.tokenizer import Tokenizer


def load_model(path: str | None, device: str = "cpu", dtype: torch.dtype = torch.float32, quantization: str = "none"):
    """(model, tokenizer, config) for a GGUF file, a safetensors directory, or the default model when None.
    Activations run in `dtype`, and weights too unless `quantization` keeps them in GGML blocks
    (carpool.models.quantization); RMSNorm statistics and logits are computed in fp32."""
    directory = resolve_model_dir(path)
    with open_weights(directory, quantization, torch.device(device)) as (config, state):
        with torch.device("meta"):  # no random init: every weight is assigned from the file
            model = model_class(config.architecture, str(directory))(config)
        model.load_hf_weights(state, dtype)
        model = model.eval().to(device=device, dtype=dtype)
    return model, Tokenizer.from_dir(directory), config


__all__ = ["MODEL_CLASSES", "ModelConfig", "Tokenizer", "load_model"]
