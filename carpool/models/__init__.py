"""Model architectures and weight loading. A new architecture is one file plus one entry in
carpool.models.registry."""

import torch

from carpool.models.config import ModelConfig
from carpool.models.layout_cache import load_with_layouts
from carpool.models.loader import gguf_source, open_weights, resolve_model_dir
from carpool.models.registry import MODEL_CLASSES, model_class
from carpool.models.tokenizer import Tokenizer


def load_model(path: str | None, device: str = "cpu", dtype: torch.dtype = torch.float32, quantization: str = "none"):
    """(model, tokenizer, config) for a GGUF file, a safetensors directory, or the default model when None.
    Activations run in `dtype`, and weights too unless `quantization` keeps them in GGML blocks
    (carpool.models.quantization); RMSNorm statistics and logits are computed in fp32. The block matrices the load
    builds are mapped from a file written on the first load (carpool.models.layout_cache), shared by every process."""
    directory = resolve_model_dir(path)
    with open_weights(directory, quantization, torch.device(device)) as (config, state):

        def build_model(layouts):
            with torch.device("meta"):  # no random init: every weight is assigned from the file
                model = model_class(config.architecture, str(directory))(config)
            model.load_hf_weights(state, dtype, layouts)
            return model

        model = load_with_layouts(directory, gguf_source(directory), quantization, state, build_model)
        model = model.eval().to(device=device, dtype=dtype)
    return model, Tokenizer.from_dir(directory), config


__all__ = ["MODEL_CLASSES", "ModelConfig", "Tokenizer", "load_model"]
