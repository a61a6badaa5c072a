"""Paged decode attention over a verifying sequence's rows (its last token and its drafts: one block table, each
row seeing one key more than the row before) read together: against torch's SDPA over each row's causal window,
bit for bit against each row attended alone (what plain decoding computes, so greedy speculation stays identical),
and which rows the kernel groups. Runs on whatever kernel build is loaded (test_isa_paths.py runs it on every path
this CPU can run)."""

import pytest
import torch
import torch.nn.functional as F

import carpool.kernels  # noqa: F401

ops = torch.ops.carpool
BLOCK_SIZE, NUM_BLOCKS, MAX_RUN_ROWS = 16, 24, 16
# (head_dim, query heads, KV heads): SmolLM2 9/3, Qwen2.5-0.5B 14/2, Qwen2.5-1.5B 12/2, Gemma 3 4/1, and a head size
# with no vector path (the scalar loop).
HEAD_LAYOUTS = [(64, 9, 3), (64, 14, 2), (128, 12, 2), (256, 4, 1), (32, 9, 3)]
# (rows, the last row's keys): one row; three rows inside a block; five rows across a block boundary (28..32 and
# 30..34); eight rows whose contexts end in every remainder of four.
RUNS = [(1, 21), (3, 11), (5, 34), (5, 17), (8, 100)]


def verify_batch(dtype, head_dim, heads, kv_heads, seed):
    """Two verifying sequences (every run in RUNS but the first, then the first) over scattered blocks."""
    g = torch.Generator().manual_seed(seed)
    k_cache = torch.randn(NUM_BLOCKS, BLOCK_SIZE, kv_heads, head_dim, generator=g).to(dtype)
    v_cache = torch.randn(NUM_BLOCKS, BLOCK_SIZE, kv_heads, head_dim, generator=g).to(dtype)
    tables, lens = [], []
    for rows, last in RUNS:
        table = torch.randperm(NUM_BLOCKS, generator=g)[:7]
        lens += range(last - rows + 1, last + 1)
        tables += [table] * rows
    q = torch.randn(len(lens), heads, head_dim, generator=g).to(dtype)
    return q, k_cache, v_cache, torch.stack(tables), torch.tensor(lens)


def sdpa_rows(q, k_cache, v_cache, tables, lens, scale, window):
    """Each row against its own keys, gathered from its table: [first key, its length), in fp32."""
    group = q.shape[1] // k_cache.shape[2]
    keys, values = (
        cache[tables].flatten(1, 2).float().repeat_interleave(group, dim=2).transpose(1, 2)
        for cache in (k_cache, v_cache)
    )  # [rows, heads, keys, head_dim]
    positions = torch.arange(keys.shape[2])
    mask = (positions < lens[:, None]) & (positions >= lens[:, None] - window if window else True)
    return F.scaled_dot_product_attention(
        q.float()[:, :, None], keys, values, attn_mask=mask[:, None, None], scale=scale
    )[:, :, 0]


@pytest.mark.parametrize("window", [0, 6])  # full attention; a sliding window shorter than every run's contexts
@pytest.mark.parametrize("head_dim,heads,kv_heads", HEAD_LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_verify_rows_match_sdpa_and_each_row_alone(dtype, head_dim, heads, kv_heads, window):
    q, k_cache, v_cache, tables, lens = verify_batch(dtype, head_dim, heads, kv_heads, seed=head_dim + heads)
    scale = head_dim**-0.5
    together = ops.paged_decode_attention(q, k_cache, v_cache, tables, lens, scale, window)
    tolerance = {"rtol": 2e-2, "atol": 2e-2} if dtype == torch.bfloat16 else {"rtol": 1e-5, "atol": 1e-5}
    torch.testing.assert_close(
        together.float(), sdpa_rows(q, k_cache, v_cache, tables, lens, scale, window), **tolerance
    )
    # The rows in reverse order: no row extends the one before it, so each is attended alone, as plain decoding does.
    backwards = torch.arange(len(lens) - 1, -1, -1)
    assert len(ops.paged_attention_runs(tables[backwards], lens[backwards], BLOCK_SIZE)) == len(lens) + 1
    alone = ops.paged_decode_attention(
        q[backwards], k_cache, v_cache, tables[backwards], lens[backwards], scale, window
    )
    assert torch.equal(together, alone[backwards])


def test_a_verifying_sequences_rows_are_read_together():
    tables = torch.tensor([[3, 1, 4]] * 3 + [[2, 0, 5]] * 2 + [[3, 1, 4]] + [[3, 5, 6]] * 2)
    lens = torch.tensor([30, 31, 32, 40, 41, 29, 30, 31])
    # Rows 0-2: one sequence's verify rows; 3-4: another's; row 5 does not extend row 4's context; row 6 does extend
    # row 5's by one key, but reads block 1 from another table: each starts a run.
    assert ops.paged_attention_runs(tables, lens, BLOCK_SIZE).tolist() == [0, 3, 5, 6, 8]
    # Only the blocks the shorter row reads must agree: 16 keys end in block 0, 17 reach block 1.
    assert ops.paged_attention_runs(torch.tensor([[7, 1], [7, 2]]), torch.tensor([16, 17]), BLOCK_SIZE).tolist() == [
        0,
        2,
    ]
    assert ops.paged_attention_runs(torch.tensor([[7, 1], [7, 2]]), torch.tensor([17, 18]), BLOCK_SIZE).tolist() == [
        0,
        1,
        2,
    ]
    # Plain decoding: a run per sequence; a run stops at MAX_RUN_ROWS rows.
    assert ops.paged_attention_runs(tables[:1].repeat(3, 1), torch.tensor([30, 30, 30]), BLOCK_SIZE).tolist() == [
        0,
        1,
        2,
        3,
    ]
    long_run = torch.arange(1, MAX_RUN_ROWS + 3)
    assert ops.paged_attention_runs(tables[:1].repeat(len(long_run), 1), long_run, BLOCK_SIZE).tolist() == [
        0,
        MAX_RUN_ROWS,
        len(long_run),
    ]


@pytest.mark.parametrize("threads", [2, 4])
@pytest.mark.parametrize("window", [0, 40])
@pytest.mark.parametrize("head_dim,heads,kv_heads", HEAD_LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_sequence_shared_among_threads_equals_one_thread(dtype, head_dim, heads, kv_heads, window, threads):
    """One sequence has a call's attention items only for its KV heads (Gemma 3's one, SmolLM2's 3): fewer than
    the threads, the kernel cuts the work finer (scores by key blocks, values by column slices). Whatever the cut,
    every output equals one thread's item kernel to the bit: a decoding row, and a verifying run's rows, at contexts
    of many key blocks (300 keys: 3 of SmolLM2's 128-key blocks, 10 of Gemma 3's 32)."""
    g = torch.Generator().manual_seed(head_dim * heads + window)
    k_cache, v_cache = (torch.randn(NUM_BLOCKS, BLOCK_SIZE, kv_heads, head_dim, generator=g).to(dtype) for _ in "kv")
    table = torch.randperm(NUM_BLOCKS, generator=g)[:20]
    scale = head_dim**-0.5
    before = torch.get_num_threads()
    for lens in ([300], [298, 299, 300, 301], [7]):
        q = torch.randn(len(lens), heads, head_dim, generator=g).to(dtype)
        args = (q, k_cache, v_cache, table.repeat(len(lens), 1), torch.tensor(lens), scale, window)
        try:
            torch.set_num_threads(1)
            alone = ops.paged_decode_attention(*args)
            torch.set_num_threads(threads)
            shared = ops.paged_decode_attention(*args)
        finally:
            torch.set_num_threads(before)
        assert torch.equal(shared, alone), lens
