"""The KV budget's split between full-attention and sliding-window pools (carpool.engine.kv_pools), and the memory
that backs them."""

from pathlib import Path

import torch

from carpool import SamplingParams
from carpool.engine.config import EngineConfig
from carpool.engine.kv_pools import kv_pool_sizes
from carpool.engine.model_runner import _zeroed_pool, resident_bytes

# Gemma 3 270M: 18 layers (15 sliding, window 512), 1 KV head of 256, bf16, 16-token blocks.
LAYERS, SLIDING, WINDOW = 18, 15, 512
BLOCK_BYTES = LAYERS * 2 * 16 * 1 * 256 * 2
LAYER_BLOCKS = 2**30 // (BLOCK_BYTES // LAYERS)  # one layer's blocks in 1 GiB


def test_without_sliding_layers_the_budget_is_one_pool():
    sizes = kv_pool_sizes(EngineConfig(), LAYERS, 0, 0, BLOCK_BYTES)
    assert (sizes.full_blocks, sizes.sliding_blocks, sizes.window) == (LAYER_BLOCKS // LAYERS, 0, 0)


def test_sliding_layers_get_every_window_and_full_layers_the_rest_of_the_same_memory():
    config = EngineConfig()
    sizes = kv_pool_sizes(config, LAYERS, SLIDING, WINDOW, BLOCK_BYTES)
    per_sequence = WINDOW // config.block_size + 1
    assert sizes.sliding_blocks >= config.max_num_seqs * per_sequence  # every sequence's window fits at once
    assert SLIDING * sizes.sliding_blocks + (LAYERS - SLIDING) * sizes.full_blocks <= LAYER_BLOCKS  # the budget
    assert sizes.full_blocks >= 3 * (LAYER_BLOCKS // LAYERS)  # 3x the context an even split would hold


def test_keeping_sliding_blocks_or_an_explicit_pool_size_keeps_the_even_split():
    kept = kv_pool_sizes(EngineConfig(free_sliding_window_blocks=False), LAYERS, SLIDING, WINDOW, BLOCK_BYTES)
    assert (kept.full_blocks, kept.sliding_blocks) == (LAYER_BLOCKS // LAYERS, 0)
    explicit = kv_pool_sizes(EngineConfig(num_kv_blocks=40), LAYERS, SLIDING, WINDOW, BLOCK_BYTES)
    assert (explicit.full_blocks, explicit.sliding_blocks, explicit.window) == (40, 40, WINDOW)


def test_a_tiny_budget_still_gives_the_sliding_pool_one_requests_worst_step():
    """At 0.01 GiB an even split leaves 36 sliding blocks, fewer than one 512-token prefill chunk past a 512-token
    window needs (65): a request the full pool admits could then never be scheduled."""
    config = EngineConfig(kv_cache_gb=0.01)
    sizes = kv_pool_sizes(config, LAYERS, SLIDING, WINDOW, BLOCK_BYTES)
    assert sizes.sliding_blocks >= WINDOW // config.block_size + 1 + config.max_num_batched_tokens // config.block_size


def _mapping_permissions(address: int) -> str:
    for line in Path("/proc/self/maps").read_text().splitlines():
        span, permissions = line.split()[:2]
        start, end = (int(part, 16) for part in span.split("-"))
        if start <= address < end:
            return permissions
    raise AssertionError(f"{address:#x} is in no mapping")


def test_the_cpu_pool_is_zeroed_private_memory(llm):
    """Shared anonymous memory is tmpfs, whose first-touch faults made write_kv_cache 2-3% of a decode step."""
    fresh = _zeroed_pool((2, 2, 8, 16, 2, 64), torch.device("cpu"), torch.float32)
    assert not fresh.abs().sum()
    for pool in (fresh, llm.engine.runner.kv_cache):
        assert pool.device.type == "cpu" and _mapping_permissions(pool.data_ptr()) == "rw-p"


def test_a_cpu_pool_is_backed_by_memory_only_where_it_was_written():
    """The soak's RSS check subtracts this: a pool's pages count once something wrote them, not at start."""
    pool = _zeroed_pool((64, 256, 1024), torch.device("cpu"), torch.float32)  # 64 MiB, 1 MiB a row
    assert resident_bytes(pool) < 1 << 20
    pool[:8] = 1.0
    assert 8 << 20 <= resident_bytes(pool) < 9 << 20
    assert resident_bytes(torch.zeros(1000)) == 4000  # not a mapping of its own: counted whole


def test_an_engine_reports_its_pools_bytes_and_what_of_them_is_resident(llm):
    llm.generate(["A fact about owls:"], SamplingParams(max_tokens=4, temperature=0))
    pool_bytes, resident = llm.engine.kv_pool_memory()
    assert pool_bytes == llm.engine.runner.kv_cache.numel() * llm.engine.runner.kv_cache.element_size()
    assert 0 < resident < pool_bytes  # one request's blocks written, not the whole pool
