"""A prompt chunk's rows through paged decode attention (a reproducible step: carpool.models.attention): one block
table, each row seeing the keys up to itself, hundreds of rows in one call. Every row's output must be the same bits
as that row attended alone (a decode step computing the token) and as that row in a batch of other sequences' rows
(cut into other runs of shared_context_runs), on either of the kernel's two code paths (the (run, KV head) items,
or those items cut finer among the threads: SplitDecodeAttention). Runs on whatever kernel build is loaded
(test_isa_paths.py runs it on every path this CPU can run)."""

import pytest
import torch
import torch.nn.functional as F
from test_verify_attention import BLOCK_SIZE, HEAD_LAYOUTS, MAX_RUN_ROWS

import carpool.kernels  # noqa: F401

ops = torch.ops.carpool
NUM_BLOCKS = 48
# (first position, rows): a chunk behind 40 keys of cached context; a chunk that starts its sequence.
CHUNKS = [(40, 300), (0, 300)]


def with_threads(threads: int, fn):
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        return fn()
    finally:
        torch.set_num_threads(before)


def chunk_reference(q, k_cache, v_cache, table, first, window, scale):
    """SDPA over the chunk's keys gathered from its table, causal (and windowed), in fp32."""
    group = q.shape[1] // k_cache.shape[2]
    context = first + q.shape[0]
    keys, values = (
        cache[table].flatten(0, 1)[:context].float().repeat_interleave(group, 1) for cache in (k_cache, v_cache)
    )
    positions, lengths = torch.arange(context), torch.arange(first + 1, context + 1)[:, None]
    mask = (positions < lengths) & (positions >= lengths - window if window else True)
    out = F.scaled_dot_product_attention(
        q.float().transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1), attn_mask=mask, scale=scale
    )
    return out.transpose(0, 1)


@pytest.mark.parametrize("first,rows", CHUNKS)
@pytest.mark.parametrize("window", [0, 40])  # full attention; a window shorter than most rows' contexts
@pytest.mark.parametrize("head_dim,heads,kv_heads", HEAD_LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prompt_chunk_rows_equal_each_row_alone_and_among_other_rows(
    dtype, head_dim, heads, kv_heads, window, first, rows
):
    g = torch.Generator().manual_seed(head_dim * heads + window + first)
    k_cache, v_cache = (torch.randn(NUM_BLOCKS, BLOCK_SIZE, kv_heads, head_dim, generator=g).to(dtype) for _ in "kv")
    scale = head_dim**-0.5
    blocks = -(-(first + rows) // BLOCK_SIZE)
    table = torch.randperm(NUM_BLOCKS, generator=g)[:blocks]
    q = torch.randn(rows, heads, head_dim, generator=g).to(dtype)
    tables, lens = table.repeat(rows, 1), torch.arange(first + 1, first + rows + 1)
    chunk = ops.paged_decode_attention(q, k_cache, v_cache, tables, lens, scale, window)
    tolerance = {"rtol": 2e-2, "atol": 2e-2} if dtype == torch.bfloat16 else {"rtol": 1e-5, "atol": 1e-5}
    torch.testing.assert_close(
        chunk.float(), chunk_reference(q, k_cache, v_cache, table, first, window, scale), **tolerance
    )

    # Each row alone, as a decode step computes it: on one thread (the items path), and with more threads than the
    # row's KV heads (the split path).
    for threads in (1, kv_heads + 1):
        alone = with_threads(
            threads,
            lambda: [
                ops.paged_decode_attention(
                    q[i : i + 1], k_cache, v_cache, tables[i : i + 1], lens[i : i + 1], scale, window
                )
                for i in range(rows)
            ],
        )
        assert torch.equal(torch.cat(alone), chunk), threads
    # The chunk's first MAX_RUN_ROWS rows alone (one run: a short prompt's chunk) with more threads than their KV
    # heads: the split path over a run of many query vectors.
    short = with_threads(
        kv_heads + 1,
        lambda: ops.paged_decode_attention(
            q[:MAX_RUN_ROWS], k_cache, v_cache, tables[:MAX_RUN_ROWS], lens[:MAX_RUN_ROWS], scale, window
        ),
    )
    assert torch.equal(short, chunk[:MAX_RUN_ROWS])

    # Among other sequences' rows: decodes and a verifying run between pieces of the chunk of every length from 1
    # to 40 rows, so the chunk's rows fall into other runs at other places in them.
    other_table = torch.randperm(NUM_BLOCKS, generator=g)[:blocks]
    mixed_q, mixed_tables, mixed_lens, chunk_rows = [], [], [], []
    at, piece = 0, 1
    while at < rows:
        others = [first + rows - piece, 3 + piece, 4 + piece, 5 + piece][: 1 + piece % 4]
        mixed_q.append(torch.randn(len(others), heads, head_dim, generator=g).to(dtype))
        mixed_tables.append(other_table.repeat(len(others), 1))
        mixed_lens.append(torch.tensor(others))
        end = min(rows, at + piece)
        chunk_rows.extend(range(sum(len(x) for x in mixed_lens), sum(len(x) for x in mixed_lens) + end - at))
        mixed_q.append(q[at:end])
        mixed_tables.append(tables[at:end])
        mixed_lens.append(lens[at:end])
        at, piece = end, piece % 40 + 1
    mixed_args = (torch.cat(mixed_q), k_cache, v_cache, torch.cat(mixed_tables), torch.cat(mixed_lens), scale, window)
    assert len(ops.paged_attention_runs(mixed_args[3], mixed_args[4], BLOCK_SIZE)) > 2 * rows // 16
    mixed = ops.paged_decode_attention(*mixed_args)
    assert torch.equal(mixed[chunk_rows], chunk)
