"""Octet-major Q4_0/Q4_1 rows (kernels/csrc/ggml_blocks.h: each eight blocks' scales together, their nibbles in
the AVX2 GEMV's pair order) are the same weights: every kernel that reads blocks gives, from them, exactly what it
gives from the GGUF rows they came from. Runs on whatever kernel build is loaded (test_isa_paths.py runs it on
every path this CPU can run), though the loader makes such rows only on OCTET_MAJOR_PATHS."""

import gguf
import pytest
import torch
from test_ggml_quants import random_blocks

from carpool.models.quantization import OCTET_MAJOR, OCTET_MAJOR_TYPES, set_matmul_mode

Q = gguf.GGMLQuantizationType
FORMATS = sorted(OCTET_MAJOR_TYPES)
# One octet; one octet and five blocks (the tail keeps GGUF's layout); four octets; SmolLM2's 576 (two and two).
WIDTHS = (256, 416, 1024, 576)
# The GEMV (1-5 rows), the batched int8 kernel (6-64), and prompt sizes (exact: the fused panels, then MKL's GEMM
# for fp32 above kFp32FusedMaxRows).
ROWS = (1, 2, 5, 6, 17, 64, 200)


def octet_major(blocks: torch.Tensor, qtype) -> torch.Tensor:
    return torch.ops.carpool.ggml_octet_major(blocks, int(qtype))


@pytest.mark.parametrize("cols", (*WIDTHS, 64))
@pytest.mark.parametrize("qtype", FORMATS, ids=lambda t: t.name)
def test_octet_major_rows_dequantize_to_the_same_weights(qtype, cols):
    blocks, _ = random_blocks(24, cols, qtype, seed=cols)
    rearranged = octet_major(blocks, qtype)
    assert rearranged.shape == blocks.shape
    # Rows of whole octets are rearranged; narrower ones (64 values: two blocks) have none to rearrange.
    assert torch.equal(rearranged, blocks) == (cols < 256)
    for dtype in (torch.float32, torch.bfloat16):
        expected = torch.ops.carpool.ggml_dequantize(blocks, int(qtype), dtype)
        assert torch.equal(torch.ops.carpool.ggml_dequantize(rearranged, int(qtype) | OCTET_MAJOR, dtype), expected)


@pytest.mark.parametrize("cols", WIDTHS)
@pytest.mark.parametrize("qtype", FORMATS, ids=lambda t: t.name)
@pytest.mark.parametrize("mode", ("exact", "int8-dot"))
def test_octet_major_rows_give_the_same_outputs_bit_for_bit(every_row_count_int8, mode, qtype, cols):
    blocks, _ = random_blocks(40, cols, qtype, seed=cols + 1)
    rearranged = octet_major(blocks, qtype)
    set_matmul_mode(mode)  # the fixture restores the thread's mode
    for rows in ROWS:
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(rows)).to(dtype)
            expected = torch.ops.carpool.ggml_linear(x, blocks, int(qtype))
            got = torch.ops.carpool.ggml_linear(x, rearranged, int(qtype) | OCTET_MAJOR)
            assert torch.equal(got, expected), f"{mode}, {rows} rows, {dtype}"


def test_only_q4_rows_are_octet_major():
    blocks, _ = random_blocks(4, 256, Q.Q8_0)
    with pytest.raises(RuntimeError, match="only Q4_0 .2. and Q4_1 .3. rows become octet-major"):
        octet_major(blocks, Q.Q8_0)
    x = torch.randn(1, 256)
    with pytest.raises(RuntimeError, match="only Q4_0 .2. and Q4_1 .3. rows are octet-major"):
        torch.ops.carpool.ggml_linear(x, blocks, int(Q.Q8_0) | OCTET_MAJOR)
