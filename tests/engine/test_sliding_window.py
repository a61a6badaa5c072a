"""Sliding-window layers (Gemma 3's local ones) keep only the KV blocks their window still needs: the same
greedy tokens as keeping everything, a bounded number of blocks per sequence, exact block accounting, and
prefix-cache hits that need only the window's blocks."""

import pytest
from block_invariants import check_block_invariants, run_with_aborts

from carpool import LLM, SamplingParams
from carpool.engine.block_manager import BlockManager
from carpool.engine.sequence import Sequence

# Dense fp32 weights: exact, and on this model faster than its Q4_K blocks (a 1,200-token prompt + 24 tokens:
# 16 s against 33 s on 2 shared cores).
ENGINE = {
    "model": "gemma-3-270m",
    "dtype": "float32",
    "quantization": "none",
    "max_num_seqs": 4,
    "num_kv_blocks": 256,
    "max_num_batched_tokens": 512,
}
# The sampled tokens' logprobs too: a greedy token can survive a few wrong keys, its logprob does not.
GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=0)


def logprobs(token_logprobs) -> list[float]:
    return [t.logprob for t in token_logprobs]


@pytest.fixture(scope="module")
def freeing():
    return LLM(**ENGINE)


@pytest.fixture(scope="module")
def keeping():
    """The reference: sliding layers keep every block, as full-attention ones do; no prefix cache either."""
    return LLM(**ENGINE, free_sliding_window_blocks=False, enable_prefix_caching=False)


@pytest.fixture(scope="module")
def long_prompt(freeing):
    """About 1,200 tokens: more than two 512-token windows, prefilled in three chunks of at most 512."""
    colors = ["red", "blue", "green"]
    text = " ".join(f"Item {i}: the {colors[i % 3]} box holds {i * 7 % 13} marbles." for i in range(90))
    ids = freeing.tokenizer.encode(text + " Which box holds the most marbles?")
    assert 1024 < len(ids) < 1300
    return ids


def test_long_generation_matches_keeping_every_block_and_holds_a_window_of_blocks(freeing, keeping, long_prompt):
    engine = freeing.engine
    window, block_size = engine.model_config.sliding_window, engine.block_manager.block_size
    seq = engine.add_request("long", long_prompt, GREEDY)
    held = []  # (full blocks, sliding blocks) after each step
    while engine.has_unfinished_requests():
        engine.step()
        check_block_invariants(engine)
        if not seq.is_finished:
            sliding = [b for b in seq.sliding_block_table if b != engine.block_manager.sliding.null_block]
            held.append((len(seq.block_table), len(sliding)))
    reference = keeping.generate(long_prompt, GREEDY)[0]
    expected = reference.token_ids
    assert seq.output_token_ids == expected
    assert logprobs(seq.logprobs) == pytest.approx(logprobs(reference.logprobs), abs=1e-4)
    assert max(s for _, s in held) <= -(-window // block_size) + 1
    assert held[-1][0] == -(-(len(long_prompt) + len(expected) - 1) // block_size)  # the full group keeps all
    assert held[-1][0] > 2 * held[-1][1]


def test_prefix_hit_with_sliding_layers_matches_a_cold_run(freeing, keeping, long_prompt):
    engine = freeing.engine
    first = freeing.generate(long_prompt, GREEDY)[0]
    follow_up = long_prompt + first.token_ids + freeing.tokenizer.encode(" And the fewest?")
    hit = freeing.generate(follow_up, GREEDY)[0]
    assert hit.num_cached_tokens >= len(long_prompt) - engine.block_manager.block_size
    cold = keeping.generate(follow_up, GREEDY)[0]
    assert hit.token_ids == cold.token_ids
    assert logprobs(hit.logprobs) == pytest.approx(logprobs(cold.logprobs), abs=1e-4)
    check_block_invariants(engine)


def test_every_block_comes_back_after_finishes_and_aborts(freeing, long_prompt):
    engine = freeing.engine
    for i in range(3):  # 600 tokens each: past the window, so sliding blocks are given back before the end
        engine.add_request(f"abort-{i}", long_prompt[i * 100 : i * 100 + 600], SamplingParams(max_tokens=4))
    run_with_aborts(engine, {2: ["abort-0"], 4: ["abort-1"]})


def _run(manager: BlockManager, seq: Sequence) -> None:
    """Prefill seq in one chunk and release it, as the engine would."""
    hits = manager.match_prefix(seq)
    assert manager.can_admit(seq, hits, seq.num_tokens)
    manager.admit(seq, hits)
    manager.allocate(seq, seq.num_tokens)
    seq.num_computed_tokens = seq.num_tokens
    manager.cache_full_blocks(seq)
    manager.free(seq)


def test_a_prefix_hit_needs_the_window_blocks_before_it_cached():
    manager = BlockManager(num_blocks=64, block_size=4, sliding_window=8)
    params = SamplingParams(max_tokens=1)
    _run(manager, Sequence("a", list(range(41)), params))
    seq = Sequence("b", list(range(41)), params)
    assert len(manager.match_prefix(seq)) == 10  # 40 tokens: all but the last, whose logits are needed
    # Evict the sliding block of tokens 32..35. A hit of 40 tokens reads keys back to 33 and one of 36 back to
    # 29: both need it. One of 32 needs keys back to 25 only: blocks 6 and 7, still cached.
    sliding = manager.sliding
    evicted = sliding.blocks[sliding.cached.pop(seq.block_hashes[8])]
    evicted.block_hash, evicted.token_ids = None, ()
    hits = manager.match_prefix(seq)
    assert len(hits) == 8
    assert manager.can_admit(seq, hits, 9)
    manager.admit(seq, hits)
    assert seq.num_computed_tokens == 32
    assert seq.sliding_block_table == [sliding.null_block] * 6 + [sliding.cached[h] for h in seq.block_hashes[6:8]]
    manager.free(seq)
    assert manager.num_free_blocks == sliding.num_free_blocks == 64
