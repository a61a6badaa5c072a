"""The GGML block kernels against gguf-py, the reference implementation of the formats."""

import gguf
import numpy as np
import pytest
import torch

import carpool.kernels  # noqa: F401
from carpool.models.quantization import GGML_TYPES

QTYPES = list(GGML_TYPES.values())


def quantized(rows: int, cols: int, qtype, seed: int = 0):
    weight = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32)
    blocks = gguf.quants.quantize(weight, qtype)
    return torch.from_numpy(blocks), torch.from_numpy(gguf.quants.dequantize(blocks, qtype).astype(np.float32))


@pytest.mark.parametrize("qtype", QTYPES, ids=lambda t: t.name)
def test_dequantize_is_exactly_gguf(qtype):
    blocks, reference = quantized(37, 96, qtype)
    assert torch.equal(torch.ops.carpool.ggml_dequantize(blocks, int(qtype), torch.float32), reference)
    assert torch.equal(torch.ops.carpool.ggml_dequantize(blocks, int(qtype), torch.bfloat16), reference.bfloat16())


@pytest.mark.parametrize("qtype", QTYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("rows", [1, 3, 4, 17, 300])  # microkernel remainders; 300 takes fp32's GEMM path
def test_linear_matches_dequantized_matmul(qtype, rows):
    blocks, weight = quantized(203, 192, qtype, seed=rows)  # 203 outputs: a partial panel and a partial tile
    x = torch.randn(rows, 192)
    expected = x.double() @ weight.double().T
    exact = torch.ops.carpool.ggml_linear(x, blocks, int(qtype))
    assert exact.dtype == torch.float32 and exact.shape == (rows, 203)
    assert (exact.double() - expected).abs().max().item() < 1e-4
    # bf16 activations: the product of bf16-rounded inputs and weights, accumulated in fp32, rounded once.
    fast = torch.ops.carpool.ggml_linear(x.bfloat16(), blocks, int(qtype))
    expected_bf16 = (x.bfloat16().double() @ weight.bfloat16().double().T).bfloat16()
    assert fast.dtype == torch.bfloat16
    torch.testing.assert_close(fast.float(), expected_bf16.float(), rtol=1.6e-2, atol=1e-3)


def test_linear_keeps_leading_dimensions():
    blocks, weight = quantized(64, 64, gguf.GGMLQuantizationType.Q8_0)
    x = torch.randn(2, 3, 64)
    out = torch.ops.carpool.ggml_linear(x, blocks, int(gguf.GGMLQuantizationType.Q8_0))
    torch.testing.assert_close(out, x @ weight.T, rtol=1e-5, atol=1e-4)


def test_bad_arguments_name_what_is_wrong():
    blocks, _ = quantized(8, 64, gguf.GGMLQuantizationType.Q4_1)
    with pytest.raises(RuntimeError, match="in_features"):
        torch.ops.carpool.ggml_linear(torch.randn(2, 32), blocks, int(gguf.GGMLQuantizationType.Q4_1))
    with pytest.raises(RuntimeError, match="qtype"):
        torch.ops.carpool.ggml_linear(torch.randn(2, 64), blocks, int(gguf.GGMLQuantizationType.Q6_K))
    with pytest.raises(RuntimeError, match="input"):
        torch.ops.carpool.ggml_linear(torch.randn(2, 64).half(), blocks, int(gguf.GGMLQuantizationType.Q4_1))
