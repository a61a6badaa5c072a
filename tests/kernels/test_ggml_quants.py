"""The GGML block kernels against gguf-py, the reference implementation of the formats. The tests call whatever
`torch.ops.carpool` is loaded, so the same file checks each ISA build (AVX-512, AVX2, portable)."""

import gguf
import numpy as np
import pytest
import torch

import carpool.kernels  # noqa: F401
from carpool.models.quantization import KERNEL_TYPES

Q = gguf.GGMLQuantizationType
QTYPES = sorted(KERNEL_TYPES)

# Where each format keeps its f16 scales in a block, and their size for weights of order 1: random bytes are
# fine for the quantized values and packed sub-scales, but random f16 bits would be NaNs and 1e4s.
F16_FIELDS = {
    Q.Q4_0: [(0, 0.2)],
    Q.Q4_1: [(0, 0.1), (2, 1.0)],  # d, m
    Q.Q5_0: [(0, 0.06)],
    Q.Q8_0: [(0, 0.01)],
    Q.Q4_K: [(0, 0.004), (2, 0.02)],  # d, dmin
    Q.Q5_K: [(0, 0.002), (2, 0.02)],
    Q.Q6_K: [(208, 0.0003)],
}


def random_blocks(rows: int, cols: int, qtype, seed: int = 0):
    """[rows, cols] weights as blocks of random bits (every bit pattern a file can hold), and gguf-py's values."""
    block_size, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (rows, cols // block_size, block_bytes), dtype=np.uint8)
    for offset, size in F16_FIELDS[qtype]:
        scales = (
            size * rng.uniform(0.5, 1.5, (rows, cols // block_size)) * rng.choice([-1, 1], (rows, cols // block_size))
        )
        blocks[..., offset : offset + 2] = scales.astype(np.float16).view(np.uint8).reshape(rows, -1, 2)
    blocks = blocks.reshape(rows, -1)
    return torch.from_numpy(blocks), torch.from_numpy(gguf.quants.dequantize(blocks, qtype).astype(np.float32))


def cols_for(qtype) -> int:
    return 2 * max(256, gguf.GGML_QUANT_SIZES[qtype][0])  # two K-quant super-blocks, sixteen 32-weight blocks


@pytest.mark.parametrize("qtype", QTYPES, ids=lambda t: t.name)
def test_dequantize_is_exactly_gguf(qtype):
    blocks, reference = random_blocks(37, cols_for(qtype), qtype)
    assert torch.equal(torch.ops.carpool.ggml_dequantize(blocks, int(qtype), torch.float32), reference)
    assert torch.equal(torch.ops.carpool.ggml_dequantize(blocks, int(qtype), torch.bfloat16), reference.bfloat16())


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q8_0], ids=lambda t: t.name)  # gguf-py quantizes these
def test_dequantize_reads_gguf_pys_own_quantization(qtype):
    weight = np.random.default_rng(1).standard_normal((5, 96)).astype(np.float32)
    blocks = gguf.quants.quantize(weight, qtype)
    reference = torch.from_numpy(gguf.quants.dequantize(blocks, qtype).astype(np.float32))
    assert torch.equal(
        torch.ops.carpool.ggml_dequantize(torch.from_numpy(blocks), int(qtype), torch.float32), reference
    )


@pytest.mark.parametrize("qtype", QTYPES, ids=lambda t: t.name)
# microkernel remainders; 300 takes fp32's GEMM path; from 6 the amx path's tiles: one vector of rows (6), two with a
# partial one (17), three (40: a pair and a lone vector)
@pytest.mark.parametrize("rows", [1, 3, 4, 6, 17, 40, 300])
def test_linear_matches_dequantized_matmul(qtype, rows):
    cols = cols_for(qtype)
    blocks, weight = random_blocks(203, cols, qtype, seed=rows)  # 203 outputs: a partial panel and a partial tile
    x = torch.randn(rows, cols)
    expected = x.double() @ weight.double().T
    exact = torch.ops.carpool.ggml_linear(x, blocks, int(qtype))
    assert exact.dtype == torch.float32 and exact.shape == (rows, 203)
    # fp32 rounding grows with the sum of |x w| terms; one wrong weight would be off by ~1/cols of it
    magnitude = (x.abs().double() @ weight.abs().double().T).max().item()
    assert (exact.double() - expected).abs().max().item() < 1e-5 * magnitude
    # bf16 activations: the product of bf16-rounded inputs and weights, accumulated in fp32, rounded once.
    fast = torch.ops.carpool.ggml_linear(x.bfloat16(), blocks, int(qtype))
    expected_bf16 = (x.bfloat16().double() @ weight.bfloat16().double().T).bfloat16()
    assert fast.dtype == torch.bfloat16
    torch.testing.assert_close(fast.float(), expected_bf16.float(), rtol=1.6e-2, atol=1e-3 * magnitude)


def test_linear_keeps_leading_dimensions():
    blocks, weight = random_blocks(64, 512, Q.Q4_K)
    x = torch.randn(2, 3, 512)
    out = torch.ops.carpool.ggml_linear(x, blocks, int(Q.Q4_K))
    torch.testing.assert_close(out, x @ weight.T, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("qtype", [Q.Q4_1, Q.Q6_K], ids=lambda t: t.name)
def test_bad_arguments_name_what_is_wrong(qtype):
    blocks, _ = random_blocks(8, 512, qtype)
    with pytest.raises(RuntimeError, match="in_features"):
        torch.ops.carpool.ggml_linear(torch.randn(2, 256), blocks, int(qtype))
    with pytest.raises(RuntimeError, match="qweight.*whole blocks"):
        torch.ops.carpool.ggml_linear(torch.randn(2, 512), blocks[:, :-1].contiguous(), int(qtype))
    with pytest.raises(RuntimeError, match="qtype"):
        torch.ops.carpool.ggml_linear(torch.randn(2, 512), blocks, int(Q.Q2_K))
    with pytest.raises(RuntimeError, match="input"):
        torch.ops.carpool.ggml_linear(torch.randn(2, 512).half(), blocks, int(qtype))
