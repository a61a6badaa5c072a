"""Which class runs which architecture, by GGUF's `general.architecture` or config.json's `architectures[0]`.
A new architecture is one file (composing carpool.models.layers) plus one entry here."""

from carpool.models.gemma3 import Gemma3ForCausalLM
from carpool.models.layers import CausalLM
from carpool.models.llama import LlamaForCausalLM
from carpool.models.qwen2 import Qwen2ForCausalLM

MODEL_CLASSES: tuple[type[CausalLM], ...] = (LlamaForCausalLM, Qwen2ForCausalLM, Gemma3ForCausalLM)
_BY_NAME = {cls.__name__: cls for cls in MODEL_CLASSES} | {cls.gguf_architecture: cls for cls in MODEL_CLASSES}


def model_class(architecture: str, where: str) -> type[CausalLM]:
    """The class for an architecture name found in `where` (a file, for the error message)."""
    cls = _BY_NAME.get(architecture)
    if cls is None:
        supported = ", ".join(f"{c.gguf_architecture} ({c.__name__})" for c in MODEL_CLASSES)
        raise ValueError(f"model: unsupported architecture {architecture!r} in {where} (supported: {supported})")
    return cls
