"""What one token costs a model in bytes moved and FLOPs, from its config and its weight files' headers.

Read without loading the weights. Bytes are counted in the format the engine runs: GGML blocks for the
weights `quantization` keeps or makes in blocks (carpool.models.quantization), `dtype` for the rest and for
the KV cache.
"""

import math
from dataclasses import dataclass

import gguf
import torch

from carpool.engine.model_runner import ModelRunner
from carpool.models.loader import default_model_path, model_name, read_config, resolve_model_dir, tensor_infos
from carpool.models.quantization import GGML_TYPES, KERNEL_TYPES, quantizable

EMBEDDING = "model.embed_tokens.weight"


@dataclass(frozen=True)
class ModelFootprint:
    name: str
    parameters: int
    matmul_parameters: int  # weights each token is multiplied by (the embedding is a lookup, not a matmul)
    streamed_bytes_per_step: int  # bytes a decode step must read: every weight but the embedding lookup's table
    kv_bytes_per_token: int  # KV cache bytes per token of context, all layers
    attention_flops_per_context_token: int  # per new token: QK^T and AV over one more token of context

    def matmul_flops_per_token(self) -> int:
        return 2 * self.matmul_parameters  # one multiply and one add per weight


def model_footprint(
    path: str | None = None, dtype: torch.dtype = torch.float32, quantization: str = "none"
) -> ModelFootprint:
    directory = resolve_model_dir(path)
    config = read_config(directory)
    infos = tensor_infos(directory)
    shapes = {name: info.shape for name, info in infos.items()}
    sizes = {name: math.prod(shape) for name, shape in shapes.items()}
    # the tensors kept in the GGUF file's own blocks, at their size in the file
    kept = {
        name: info.nbytes
        for name, info in infos.items()
        if quantization == "auto" and info.ggml_type in KERNEL_TYPES and len(info.shape) == 2
    }

    def weight_bytes(name: str) -> int:
        if name in kept:
            return kept[name]
        if quantization in GGML_TYPES and quantizable(shapes[name], GGML_TYPES[quantization]):
            block_size, block_bytes = gguf.GGML_QUANT_SIZES[GGML_TYPES[quantization]]
            return sizes[name] // block_size * block_bytes
        return sizes[name] * dtype.itemsize

    parameters = sum(sizes.values())
    # A tied model's output projection multiplies by the embedding table, so that table is streamed after all.
    lookup_only = 0 if config.tie_word_embeddings else sizes.get(EMBEDDING, 0)
    matrices = sum(sizes[name] for name, shape in shapes.items() if len(shape) == 2)  # norms are vectors
    return ModelFootprint(
        name=model_name(path or default_model_path()),
        parameters=parameters,
        matmul_parameters=matrices - lookup_only,
        streamed_bytes_per_step=sum(weight_bytes(name) for name in shapes)
        - (weight_bytes(EMBEDDING) if lookup_only else 0),
        kv_bytes_per_token=ModelRunner.kv_bytes_per_block(config, block_size=1, dtype=dtype),
        attention_flops_per_context_token=4 * config.num_layers * config.num_heads * config.head_dim,
    )
