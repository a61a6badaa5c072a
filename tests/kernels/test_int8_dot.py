"""ggml_linear's int8-dot mode against torch: activations quantized to int8 the way the kernel does (per 32 values
for the 32-weight formats, per 256 for the K-quants), times gguf-py's dequantized weights, in float64. Runs on
whatever kernel build is loaded (test_isa_paths.py runs it on every path this CPU can run)."""

import pytest
import torch
from test_ggml_quants import QTYPES, Q, random_blocks

import carpool.kernels  # noqa: F401

EXACT, INT8_DOT = 0, 1
MAX_ROWS = torch.ops.carpool.int8_dot_max_rows()


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


@pytest.mark.parametrize("qtype", QTYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("rows", sorted({1, 2, MAX_ROWS, MAX_ROWS + 1}))
def test_int8_dot_equals_quantized_activations_times_weights(int8_dot, qtype, rows):
    cols = 1024
    blocks, weight = random_blocks(37, cols, qtype, seed=rows)  # 37 outputs: odd, not a multiple of any split
    x = torch.randn(rows, cols)
    x[0, 32:64] = 0  # a block of zeros has scale 0
    out = torch.ops.carpool.ggml_linear(x, blocks, int(qtype))
    assert out.dtype == torch.float32 and out.shape == (rows, 37)
    magnitude = (x.abs().double() @ weight.abs().double().T).max().item()
    if rows > MAX_ROWS:  # more rows: the exact path, bit for bit
        torch.ops.carpool.set_matmul_mode(EXACT)
        assert torch.equal(out, torch.ops.carpool.ggml_linear(x, blocks, int(qtype)))
        return
    expected = quantized_activations(x, block_of(qtype)) @ weight.double().T
    # fp32 rounding of the block scales and sums; one wrong weight would be off by ~1/cols of the magnitude
    assert (out.double() - expected).abs().max().item() < 2e-6 * magnitude
    # and the int8 rounding itself is small but real: this is not the exact product
    exact = x.double() @ weight.double().T
    assert 0 < (out.double() - exact).abs().max().item() < 2e-2 * magnitude
    # bf16 activations: the same int8 values (quantized from the bf16 inputs), the sum rounded to bf16 once.
    fast = torch.ops.carpool.ggml_linear(x.bfloat16(), blocks, int(qtype))
    expected_bf16 = (quantized_activations(x.bfloat16(), block_of(qtype)) @ weight.double().T).bfloat16()
    assert fast.dtype == torch.bfloat16
    torch.testing.assert_close(fast.float(), expected_bf16.float(), rtol=8e-3, atol=1e-5 * magnitude)


def test_exact_mode_is_the_default_and_modes_are_checked():
    blocks, weight = random_blocks(16, 256, Q.Q4_K)
    x = torch.randn(1, 256)
    assert torch.ops.carpool.get_matmul_mode() == EXACT
    exact = torch.ops.carpool.ggml_linear(x, blocks, int(Q.Q4_K))
    torch.testing.assert_close(exact, x @ weight.T, rtol=1e-5, atol=1e-4)
    with pytest.raises(RuntimeError, match="matmul"):
        torch.ops.carpool.set_matmul_mode(2)
    assert torch.ops.carpool.get_matmul_mode() == EXACT


def test_the_mode_belongs_to_the_thread_that_set_it(int8_dot):
    import threading

    seen = []
    thread = threading.Thread(target=lambda: seen.append(torch.ops.carpool.get_matmul_mode()))
    thread.start()
    thread.join()
    assert seen == [EXACT] and torch.ops.carpool.get_matmul_mode() == INT8_DOT
