"""Q4_K and Q6_K matrices in row groups (kernels/csrc/ggml_blocks.h: eight rows' blocks word-interleaved) are the same
weights: dequantized, in exact mode and in the batched int8 kernel they give exactly what their GGUF rows give, and
the GEMV that reads the groups in place (1-8 rows) computes the int8 product as the GGUF rows' GEMV does, to fp32
rounding. Runs on whatever kernel build is loaded (test_isa_paths.py runs it on every path this CPU can run), though
the loader makes row groups only on ROW_GROUP_PATHS."""

import pytest
import torch
from test_ggml_quants import Q, random_blocks
from test_int8_dot import quantized_activations

from carpool.models.quantization import ROW_GROUPS, set_matmul_mode

FORMATS = (Q.Q4_K, Q.Q6_K)
WIDTHS = (256, 1536)  # one block a row; the 1.5B's hidden size (six)
# The GEMV (1-8 rows for row groups, kRowGroupGemvMaxRows: passes of four), the batched int8 kernel (9-64), prompt
# sizes (exact, and fp32 above kFp32FusedMaxRows through a dequantized copy).
GEMV_ROWS = (1, 2, 3, 4, 5, 8)
OTHER_ROWS = (9, 17, 23, 34, 64, 200)


def row_groups(blocks: torch.Tensor, qtype) -> torch.Tensor:
    return torch.ops.carpool.ggml_row_groups(blocks, int(qtype))


@pytest.mark.parametrize("qtype", FORMATS)
@pytest.mark.parametrize("cols", WIDTHS)
def test_row_groups_hold_the_same_bytes_and_weights(qtype, cols):
    blocks, _ = random_blocks(24, cols, qtype, seed=cols)
    grouped = row_groups(blocks, qtype)
    assert grouped.shape == blocks.shape and not torch.equal(grouped, blocks)
    assert torch.equal(torch.ops.carpool.ggml_gguf_rows(grouped, int(qtype) | ROW_GROUPS), blocks)
    # each row's bytes moved, none lost: the same multiset of bytes per group of eight rows
    assert torch.equal(grouped.view(3, -1).sort(-1).values, blocks.view(3, -1).sort(-1).values)
    for dtype in (torch.float32, torch.bfloat16):
        expected = torch.ops.carpool.ggml_dequantize(blocks, int(qtype), dtype)
        assert torch.equal(torch.ops.carpool.ggml_dequantize(grouped, int(qtype) | ROW_GROUPS, dtype), expected)


@pytest.mark.parametrize("qtype", FORMATS)
@pytest.mark.parametrize("cols", WIDTHS)
@pytest.mark.parametrize("mode", ("exact", "int8-dot"))
def test_row_groups_give_the_same_outputs_bit_for_bit_past_the_gemv(every_row_count_int8, mode, qtype, cols):
    blocks, _ = random_blocks(40, cols, qtype, seed=cols + 1)
    grouped = row_groups(blocks, qtype)
    set_matmul_mode(mode)  # the fixture restores the thread's mode
    for rows in (*OTHER_ROWS, *(GEMV_ROWS if mode == "exact" else ())):
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(rows)).to(dtype)
            expected = torch.ops.carpool.ggml_linear(x, blocks, int(qtype))
            out = torch.ops.carpool.ggml_linear(x, grouped, int(qtype) | ROW_GROUPS)
            assert torch.equal(out, expected), (mode, rows)


@pytest.mark.parametrize("qtype", FORMATS)
@pytest.mark.parametrize("cols", WIDTHS)
@pytest.mark.parametrize("rows", GEMV_ROWS)
def test_row_group_gemv_equals_quantized_activations_times_weights(every_row_count_int8, rows, qtype, cols):
    blocks, weight = random_blocks(40, cols, qtype, seed=rows)  # five groups: two threads split them unevenly
    grouped = row_groups(blocks, qtype)
    x = torch.randn(rows, cols)
    x[-1] *= 100  # rows quantize apart: each row's scales are its own
    out = torch.ops.carpool.ggml_linear(x, grouped, int(qtype) | ROW_GROUPS)
    magnitude = (x.abs().double() @ weight.abs().double().T).max(-1, keepdim=True).values
    expected = quantized_activations(x, 256) @ weight.double().T
    assert ((out.double() - expected).abs() / magnitude).max().item() < 2e-6  # as test_int8_dot's bound
    gguf_rows = torch.ops.carpool.ggml_linear(x, blocks, int(qtype))
    assert ((out.double() - gguf_rows.double()).abs() / magnitude).max().item() < 2e-6
    fast = torch.ops.carpool.ggml_linear(x.bfloat16(), grouped, int(qtype) | ROW_GROUPS)
    expected_bf16 = (quantized_activations(x.bfloat16(), 256) @ weight.double().T).bfloat16()
    error = (fast.double() - expected_bf16.double()).abs()
    assert fast.dtype == torch.bfloat16 and (error <= 8e-3 * expected_bf16.double().abs() + 1e-5 * magnitude).all()


def test_only_whole_groups_of_q4_k_and_q6_k_rows_are_grouped():
    blocks, _ = random_blocks(12, 256, Q.Q4_K)
    with pytest.raises(RuntimeError, match="12 rows do not split into groups of 8"):
        row_groups(blocks, Q.Q4_K)
    with pytest.raises(RuntimeError, match="12 rows in row groups is not whole groups of 8"):
        torch.ops.carpool.ggml_linear(torch.randn(1, 256), blocks, int(Q.Q4_K) | ROW_GROUPS)
    q5_k, _ = random_blocks(8, 256, Q.Q5_K)
    with pytest.raises(RuntimeError, match=r"only Q4_K \(12\) and Q6_K \(14\) rows go in row groups"):
        torch.ops.carpool.ggml_row_groups(q5_k, int(Q.Q5_K))
    with pytest.raises(RuntimeError, match=r"only Q4_K \(12\) and Q6_K \(14\) rows come in row groups"):
        torch.ops.carpool.ggml_linear(torch.randn(1, 256), q5_k, int(Q.Q5_K) | ROW_GROUPS)
