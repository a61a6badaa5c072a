"""ggml_linear's int8-dot mode against torch: activations quantized to int8 the way the kernel does (per 32 values
for the 32-weight formats, per 256 for the K-quants), times gguf-py's dequantized weights, in float64. Few rows run
the GEMV, more the batched kernel (ggml_gemm.cpp, where the build has one for the format). Runs on whatever kernel
build is loaded (test_isa_paths.py runs it on every path this CPU can run)."""

import gguf
import numpy as np
import pytest
import torch
from test_ggml_quants import QTYPES, Q, random_blocks

from carpool.kernels import kernel_path

EXACT, INT8_DOT = 0, 1
GEMV_ROWS = 5  # kInt8GemvMaxRows (a pass of four rows and one): more rows take the batched kernel
# Row counts across the batched kernel's shapes: 8-row and 16-row vectors, one and two vectors a tile, partial ones;
# on 16-row vectors, a grouped last vector beside a whole one (17: a row over four lanes, 23: seven over two) and
# after whole tiles (40).
BATCH_ROWS = (6, 8, 17, 23, 40, 64)


@pytest.fixture
def int8_dot():
    previous = torch.ops.carpool.set_matmul_mode(INT8_DOT)
    yield
    torch.ops.carpool.set_matmul_mode(previous)


def block_of(qtype) -> int:
    return 256 if qtype in (Q.Q4_K, Q.Q5_K, Q.Q6_K) else 32


def quantized_activations(x: torch.Tensor, block: int) -> torch.Tensor:
    """x as the kernel sees it: d = max|x| / 127 per block, q = round-half-even(x * (1 / d)), values q * d."""
    rows, cols = x.shape
    blocks = x.float().reshape(rows, cols // block, block)
    d = blocks.abs().amax(-1, keepdim=True) / 127
    inverse = torch.where(d != 0, 1 / d, torch.zeros_like(d))
    q = torch.round(blocks * inverse)
    assert q.abs().max() <= 127
    return (q.double() * d.double()).reshape(rows, cols)


# (format, row width): every format at 1024 values; the GEMV takes the 32-weight formats eight blocks at a time, and
# 416 values are one run of eight and five more.
WIDTHS = [*((qtype, 1024) for qtype in QTYPES), *((qtype, 416) for qtype in QTYPES if block_of(qtype) == 32)]


@pytest.mark.parametrize(("qtype", "cols"), WIDTHS, ids=lambda v: v.name if isinstance(v, Q) else str(v))
@pytest.mark.parametrize("rows", (1, 2, GEMV_ROWS, *BATCH_ROWS))
def test_int8_dot_equals_quantized_activations_times_weights(every_row_count_int8, qtype, rows, cols):
    blocks, weight = random_blocks(37, cols, qtype, seed=rows)  # 37 outputs: odd, not a multiple of any split
    x = torch.randn(rows, cols)
    x[0, 32:64] = 0  # a block of zeros has scale 0
    x[-1] *= 100  # rows quantize apart: each row's scales are its own
    out = torch.ops.carpool.ggml_linear(x, blocks, int(qtype))
    assert out.dtype == torch.float32 and out.shape == (rows, 37)
    magnitude = (x.abs().double() @ weight.abs().double().T).max(-1, keepdim=True).values
    expected = quantized_activations(x, block_of(qtype)) @ weight.double().T
    # fp32 rounding of the block scales and sums; one wrong weight would be off by ~1/cols of the magnitude
    assert ((out.double() - expected).abs() / magnitude).max().item() < 2e-6
    # and the int8 rounding itself is small but real: this is not the exact product
    exact = x.double() @ weight.double().T
    assert 0 < ((out.double() - exact).abs() / magnitude).max().item() < 2e-2
    # bf16 activations: the same int8 values (quantized from the bf16 inputs), the sum rounded to bf16 once.
    fast = torch.ops.carpool.ggml_linear(x.bfloat16(), blocks, int(qtype))
    expected_bf16 = (quantized_activations(x.bfloat16(), block_of(qtype)) @ weight.double().T).bfloat16()
    assert fast.dtype == torch.bfloat16
    error = (fast.double() - expected_bf16.double()).abs()
    assert (error <= 8e-3 * expected_bf16.double().abs() + 1e-5 * magnitude).all()


@pytest.mark.parametrize("qtype", QTYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("rows", (1, 8, 40))  # the GEMV, one row vector, tiles of two vectors and one left over
def test_activations_round_half_to_even(every_row_count_int8, qtype, rows):
    """Every block's largest value is 127, so d = 1 and each half-integer in x is a tie: the kernels' vector
    quantization must round it as nearbyint does (to even), not away from zero."""
    cols = 1024
    blocks, weight = random_blocks(37, cols, qtype, seed=rows)
    generator = torch.Generator().manual_seed(rows)
    x = torch.randint(-60, 60, (rows, cols), generator=generator).float() + 0.5
    x[:, :: block_of(qtype)] = 127.0
    out = torch.ops.carpool.ggml_linear(x, blocks, int(qtype)).double()
    magnitude = (x.abs().double() @ weight.abs().double().T).max(-1, keepdim=True).values
    to_even = torch.round(x).double() @ weight.double().T
    away_from_zero = (torch.sign(x) * torch.floor(x.abs() + 0.5)).double() @ weight.double().T
    assert ((out - to_even).abs() / magnitude).max().item() < 2e-6
    assert ((out - away_from_zero).abs() / magnitude).max().item() > 1e-4


# Each format's bytes of weight integers within a block (the rest: its float and integer scales), and the byte
# that puts every integer at the low or the high end of its range (Q8_0's are int8, the others unsigned bit fields).
QUANT_BYTES = {
    Q.Q4_0: (2, 18),
    Q.Q4_1: (4, 20),
    Q.Q5_0: (2, 22),
    Q.Q8_0: (2, 34),
    Q.Q4_K: (16, 144),
    Q.Q5_K: (16, 176),
    Q.Q6_K: (0, 192),
}
END_BYTES = {"low": {Q.Q8_0: 0x80}, "high": {Q.Q8_0: 0x7F}}
END_BYTE_DEFAULT = {"low": 0x00, "high": 0xFF}


@pytest.mark.parametrize("qtype", QTYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("end", ("low", "high"))
@pytest.mark.parametrize("sign", (1, -1), ids=("positive", "negative"))
def test_integer_sums_at_their_extremes_do_not_overflow(every_row_count_int8, qtype, end, sign):
    """Every activation at +-127 and every weight integer at an end of its range, one sign throughout: the largest
    sums the kernels' narrow accumulators see (AVX2's int16 pairs widen every GemmLayout::kPairSteps steps)."""
    cols = 1024
    blocks, _ = random_blocks(37, cols, qtype)
    block_bytes = gguf.GGML_QUANT_SIZES[qtype][1]
    first, last = QUANT_BYTES[qtype]
    raw = blocks.numpy().reshape(37, -1, block_bytes).copy()
    raw[..., first:last] = END_BYTES[end].get(qtype, END_BYTE_DEFAULT[end])
    blocks = torch.from_numpy(raw.reshape(37, -1))
    weight = torch.from_numpy(gguf.quants.dequantize(raw.reshape(37, -1), qtype).astype(np.float32))
    x = torch.full((40, cols), float(sign))  # d = 1 / 127 per block, every q = +-127
    out = torch.ops.carpool.ggml_linear(x, blocks, int(qtype)).double()
    expected = quantized_activations(x, block_of(qtype)) @ weight.double().T
    magnitude = (x.abs().double() @ weight.abs().double().T).max(-1, keepdim=True).values
    assert ((out - expected).abs() / magnitude).max().item() < 2e-6


# The formats whose integer kernels stay ahead of the exact path at prompt sizes, per kernel path: their int8-dot
# mode takes every row (ggml_dot.cpp's default_max_rows); every other format takes decode batches only.
EVERY_ROW = {"amx": set(), "avx512": {Q.Q4_K, Q.Q5_K, Q.Q6_K}, "avxvnni": set(), "avx2": set(), "portable": set()}


@pytest.mark.parametrize("qtype", QTYPES, ids=lambda t: t.name)
def test_each_format_has_its_builds_row_limit(qtype):
    limit = torch.ops.carpool.int8_dot_max_rows(int(qtype))
    if qtype in EVERY_ROW[kernel_path()]:
        assert limit >= 1 << 62  # prompt chunks of any size
    else:
        assert 1 <= limit <= 64  # decode batches only: prompts stay exact


@pytest.mark.parametrize("qtype", QTYPES, ids=lambda t: t.name)
def test_rows_above_the_formats_limit_run_the_exact_path_bit_for_bit(int8_dot, qtype):
    limit = min(torch.ops.carpool.int8_dot_max_rows(int(qtype)), 64)
    previous = torch.ops.carpool.set_int8_dot_max_rows(int(qtype), limit)
    try:
        blocks, _ = random_blocks(37, 512, qtype)
        x = torch.randn(limit + 1, 512)
        out = torch.ops.carpool.ggml_linear(x, blocks, int(qtype))
    finally:
        torch.ops.carpool.set_int8_dot_max_rows(int(qtype), previous)
    torch.ops.carpool.set_matmul_mode(EXACT)
    assert torch.equal(out, torch.ops.carpool.ggml_linear(x, blocks, int(qtype)))


def test_row_limits_are_checked_and_belong_to_each_format(int8_dot):
    with pytest.raises(RuntimeError, match="qtype"):
        torch.ops.carpool.int8_dot_max_rows(7)
    with pytest.raises(RuntimeError, match="rows"):
        torch.ops.carpool.set_int8_dot_max_rows(int(Q.Q4_K), -1)
    blocks, _ = random_blocks(16, 256, Q.Q4_K)
    x = torch.randn(2, 256)
    exact_rows = torch.ops.carpool.ggml_linear(x, blocks, int(Q.Q4_K))
    q6_limit = torch.ops.carpool.int8_dot_max_rows(int(Q.Q6_K))
    previous = torch.ops.carpool.set_int8_dot_max_rows(int(Q.Q4_K), 1)
    try:
        assert torch.ops.carpool.int8_dot_max_rows(int(Q.Q4_K)) == 1
        assert torch.ops.carpool.int8_dot_max_rows(int(Q.Q6_K)) == q6_limit
        two_rows = torch.ops.carpool.ggml_linear(x, blocks, int(Q.Q4_K))  # above the limit now: exact
    finally:
        torch.ops.carpool.set_int8_dot_max_rows(int(Q.Q4_K), previous)
    torch.ops.carpool.set_matmul_mode(EXACT)
    assert torch.equal(two_rows, torch.ops.carpool.ggml_linear(x, blocks, int(Q.Q4_K)))
    assert not torch.equal(exact_rows, two_rows)  # 2 rows are under Q4_K's own limit: int8-dot


def test_exact_mode_is_the_default_and_modes_are_checked():
    blocks, weight = random_blocks(16, 256, Q.Q4_K)
    x = torch.randn(1, 256)
    assert torch.ops.carpool.get_matmul_mode() == EXACT
    exact = torch.ops.carpool.ggml_linear(x, blocks, int(Q.Q4_K))
    torch.testing.assert_close(exact, x @ weight.T, rtol=1e-5, atol=1e-4)
    with pytest.raises(RuntimeError, match="matmul"):
        torch.ops.carpool.set_matmul_mode(3)
    assert torch.ops.carpool.get_matmul_mode() == EXACT


def test_the_mode_belongs_to_the_thread_that_set_it(int8_dot):
    import threading

    seen = []
    thread = threading.Thread(target=lambda: seen.append(torch.ops.carpool.get_matmul_mode()))
    thread.start()
    thread.join()
    assert seen == [EXACT] and torch.ops.carpool.get_matmul_mode() == INT8_DOT


@pytest.mark.parametrize("qtype", QTYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("rows", (1, GEMV_ROWS, *BATCH_ROWS))
def test_bf16_outputs_are_the_fp32_sums_rounded_as_torch_rounds(every_row_count_int8, qtype, rows):
    """The kernels compute in fp32 whatever the activations' dtype and round each output to bf16 once, exactly as
    torch rounds (to nearest, ties to even): bit for bit, which a tolerance could not tell from truncation."""
    blocks, _ = random_blocks(37, 1024, qtype, seed=rows)
    x = torch.randn(rows, 1024).bfloat16()
    out = torch.ops.carpool.ggml_linear(x, blocks, int(qtype))
    expected = torch.ops.carpool.ggml_linear(x.float(), blocks, int(qtype)).bfloat16()
    assert torch.equal(out.view(torch.int16), expected.view(torch.int16))


@pytest.mark.parametrize("qtype", QTYPES, ids=lambda t: t.name)
def test_a_rows_output_does_not_depend_on_the_rows_beside_it(every_row_count_int8, qtype):
    """Every batched call (6 rows on) gives each row the same bits as a 48-row call does: whole vectors of rows
    and the last vector's grouped layouts (a few rows, each over two or four lanes) alike."""
    blocks, _ = random_blocks(37, 1024, qtype, seed=5)
    x = torch.randn(48, 1024)
    everyone = torch.ops.carpool.ggml_linear(x, blocks, int(qtype))
    for rows in range(GEMV_ROWS + 1, 48):
        assert torch.equal(torch.ops.carpool.ggml_linear(x[:rows], blocks, int(qtype)), everyone[:rows]), rows


@pytest.mark.parametrize("qtype", QTYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("rows", (40, 300))  # a decode batch (a panel a tile) and a prompt chunk (panels of tiles)
def test_batched_outputs_do_not_depend_on_the_thread_count(every_row_count_int8, qtype, rows):
    """The batched kernel's threads claim panels of columns as they go: whoever computes a column, and in whatever
    order, every output is the same sum. 203 columns: not a multiple of any panel, so the last one is partial."""
    blocks, _ = random_blocks(203, 1024, qtype, seed=rows)
    x = torch.randn(rows, 1024).bfloat16()
    previous = torch.get_num_threads()
    try:
        outs = []
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            outs.append(torch.ops.carpool.ggml_linear(x, blocks, int(qtype)))
    finally:
        torch.set_num_threads(previous)
    assert all(torch.equal(outs[0], out) for out in outs[1:])
