"""How the KV cache's memory splits between its groups: full-attention layers and sliding-window layers.

Sliding layers (Gemma 3's local ones) keep at most a window of keys per sequence, so their pool needs only enough
blocks for every sequence's window, and the rest of the budget goes to the full-attention layers, which hold
whole contexts. That is how freeing sliding blocks turns into capacity: Gemma 3 270M at 1 GiB in bf16 (3 full,
15 sliding layers, window 512, 64 sequences) gets 11,120 full-attention blocks instead of 3,640 with an even
split: 3.05x the tokens in the same memory. Admission checks both groups, so a sliding pool that runs short makes requests wait,
never fail.
"""

from dataclasses import dataclass

from carpool.engine.block_manager import cdiv
from carpool.engine.config import EngineConfig


@dataclass(frozen=True)
class KVPoolSizes:
    full_blocks: int  # blocks of the full-attention layers' pool: what bounds a request's context
    sliding_blocks: int  # blocks of the sliding layers' pool (0: the model has none, or keeps them all)
    window: int  # the sliding layers' window in tokens (0: none)


def kv_pool_sizes(
    config: EngineConfig, num_layers: int, num_sliding_layers: int, window: int, bytes_per_block: int
) -> KVPoolSizes:
    """`bytes_per_block`: one block of every layer's keys and values. `config.num_kv_blocks`, when set, is the
    full-attention pool's size; otherwise `config.kv_cache_gb` is split between the pools."""
    if not (window and num_sliding_layers and config.free_sliding_window_blocks):
        blocks = config.num_kv_blocks or max(1, int(config.kv_cache_gb * 2**30 // bytes_per_block))
        return KVPoolSizes(blocks, 0, 0)
    # Every sequence's window (its blocks from the window's first key to the next query, ceil(window / block) + 1),
    # plus the blocks one step's prefill chunks reach past their windows, plus the pool's placeholder block.
    need = (
        config.max_num_seqs * (cdiv(window, config.block_size) + 1)
        + cdiv(config.max_num_batched_tokens, config.block_size)
        + 1
    )
    if config.num_kv_blocks:
        return KVPoolSizes(config.num_kv_blocks, min(config.num_kv_blocks, need), window)
    layer_blocks = int(config.kv_cache_gb * 2**30 // (bytes_per_block // num_layers))  # blocks of one layer
    num_full_layers = num_layers - num_sliding_layers
    even = layer_blocks // num_layers
    # Never below one request's worst step (its window and a whole prefill chunk past it): the full pool admits
    # requests by its own size, and one that could never get its sliding blocks would wait forever.
    one_request = cdiv(window, config.block_size) + 1 + cdiv(config.max_num_batched_tokens, config.block_size)
    sliding = min(need, max(even, one_request))
    return KVPoolSizes(
        max(1, (layer_blocks - num_sliding_layers * sliding) // max(1, num_full_layers)), sliding, window
    )
