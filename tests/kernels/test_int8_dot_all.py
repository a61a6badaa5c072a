"""matmul "int8-dot-all": the integer kernels on every call, prompt chunks of hundreds of rows included, against
torch (int8-quantized activations times gguf-py's weights, float64). Runs on whatever kernel build is loaded
(test_isa_paths.py runs it on every path this CPU can run)."""

import pytest
import torch
from test_ggml_quants import QTYPES, Q, random_blocks
from test_int8_dot import EVERY_ROW, EXACT, INT8_DOT, block_of, quantized_activations

from carpool.kernels import kernel_path

INT8_DOT_ALL = 2
# 130 rows at 4096 values: past the int8-dot row limit of every format that has one (64 at most) and past one row block of the batched
# kernel (ggml_gemm.cpp: 128 KiB of activations, 16-32 rows at this width), so panels of several tiles run over
# several row blocks, the last one partial; 37 outputs leave a partial panel and a partial tile.
ROWS, COLS, OUTPUTS = 130, 4096, 37


def linear(mode: int, x: torch.Tensor, blocks: torch.Tensor, qtype) -> torch.Tensor:
    previous = torch.ops.carpool.set_matmul_mode(mode)
    try:
        return torch.ops.carpool.ggml_linear(x, blocks, int(qtype))
    finally:
        torch.ops.carpool.set_matmul_mode(previous)


@pytest.mark.parametrize("qtype", QTYPES, ids=lambda t: t.name)
def test_prompt_sized_calls_run_the_integer_kernels(qtype):
    blocks, weight = random_blocks(OUTPUTS, COLS, qtype, seed=3)
    x = torch.randn(ROWS, COLS)
    x[-1] *= 100  # each row quantizes by its own scales
    out = linear(INT8_DOT_ALL, x, blocks, qtype)
    magnitude = (x.abs().double() @ weight.abs().double().T).max(-1, keepdim=True).values
    expected = quantized_activations(x, block_of(qtype)) @ weight.double().T
    # fp32 rounding of the block scales and sums; one wrong weight would be off by ~1/COLS of the magnitude
    assert ((out.double() - expected).abs() / magnitude).max().item() < 2e-6
    # not the exact path, which differs by the rounding; int8-dot mode at these rows is the exact path unless the
    # format takes every row in this build (the K-quants on avx512)
    exact = linear(EXACT, x, blocks, qtype)
    every_row = torch.ops.carpool.int8_dot_max_rows(int(qtype)) >= ROWS
    assert every_row == (qtype in EVERY_ROW[kernel_path()])
    assert torch.equal(linear(INT8_DOT, x, blocks, qtype), out if every_row else exact)
    assert 1e-5 < ((out.double() - exact.double()).abs() / magnitude).max().item() < 2e-2
    # the very kernel int8-dot runs on a decode batch: the same values as with the row limit lifted
    previous = torch.ops.carpool.set_int8_dot_max_rows(int(qtype), ROWS)
    try:
        assert torch.equal(linear(INT8_DOT, x, blocks, qtype), out)
    finally:
        torch.ops.carpool.set_int8_dot_max_rows(int(qtype), previous)


@pytest.mark.parametrize("qtype", [Q.Q4_1, Q.Q6_K], ids=lambda t: t.name)
def test_bf16_prompt_rows_round_the_same_sums_once(qtype):
    blocks, weight = random_blocks(OUTPUTS, COLS, qtype, seed=4)
    x = torch.randn(ROWS, COLS).bfloat16()
    out = linear(INT8_DOT_ALL, x, blocks, qtype)
    assert out.dtype == torch.bfloat16 and out.shape == (ROWS, OUTPUTS)
    expected = (quantized_activations(x, block_of(qtype)) @ weight.double().T).bfloat16().double()
    magnitude = (x.abs().double() @ weight.abs().double().T).max(-1, keepdim=True).values
    assert ((out.double() - expected).abs() <= 8e-3 * expected.abs() + 1e-5 * magnitude).all()


def test_the_mode_is_checked_and_restored():
    with pytest.raises(RuntimeError, match="matmul"):
        torch.ops.carpool.set_matmul_mode(3)
    assert torch.ops.carpool.set_matmul_mode(INT8_DOT_ALL) == EXACT
    assert torch.ops.carpool.set_matmul_mode(EXACT) == INT8_DOT_ALL
