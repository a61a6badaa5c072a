"""What one token costs a model in bytes moved and FLOPs, from its config and its weight files' headers.

Read without loading the weights. The engine holds weights and KV cache in fp32 (4 bytes) whatever the file's
format, so that is the size counted here.
"""

import math
from dataclasses import dataclass
from pathlib import Path

from safetensors import safe_open

from carpool.engine.model_runner import ModelRunner
from carpool.models.loader import (
    read_config,
    default_model_path,
    model_name,
    resolve_model_dir,
)

ENGINE_BYTES_PER_PARAMETER = 4
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


def model_footprint(path: str | None = None) -> ModelFootprint:
    directory = resolve_model_dir(path)
    config = read_config(directory)
    shapes = {}
    for file in sorted(Path(directory).glob("*.safetensors")):
        with safe_open(str(file), "pt") as weights:
            shapes.update({name: weights.get_slice(name).get_shape() for name in weights.keys()})
    sizes = {name: math.prod(shape) for name, shape in shapes.items()}
    parameters = sum(sizes.values())
    # A tied model's output projection multiplies by the embedding table, so that table is streamed after all.
    lookup_only = 0 if config.tie_word_embeddings else sizes.get(EMBEDDING, 0)
    matrices = sum(sizes[name] for name, shape in shapes.items() if len(shape) == 2)  # norms are vectors
    return ModelFootprint(
        name=model_name(path or default_model_path()),
        parameters=parameters,
        matmul_parameters=matrices - lookup_only,
        streamed_bytes_per_step=(parameters - lookup_only) * ENGINE_BYTES_PER_PARAMETER,
        kv_bytes_per_token=ModelRunner.kv_bytes_per_block(config, block_size=1),
        attention_flops_per_context_token=4 * config.num_layers * config.num_heads * config.head_dim,
    )
