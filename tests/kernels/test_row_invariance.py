"""Issue 53: in the integer kernels a row's output is the same bits however many rows share its call, whichever of
the GEMV (1 to 5 rows; 8 on row groups), the batched kernel (more) or a prompt-sized call computes it, on every
weight layout the loader uses (GGUF rows, octet-major Q4_0/Q4_1, Q4_K/Q6_K row groups), in fp32 and bf16. Runs on
whatever kernel build is loaded (test_isa_paths.py runs it on every path this CPU can run)."""

import pytest
import torch
from test_ggml_quants import QTYPES, Q, random_blocks

from carpool.models.quantization import OCTET_MAJOR, OCTET_MAJOR_TYPES, ROW_GROUPS

# 1 to 40 rows: every GEMV pass shape (1-4 rows, 4 + 1, two passes of row groups), the batched kernel's partial and
# whole vectors and tiles; 130: a prompt chunk past one row block of the batched kernel.
ROWS = (*range(1, 41), 130)
# 576: SmolLM2's width (18 blocks of 32: two octets and a tail of two); 1536: the 1.5B's (six K-quant blocks).
WIDTHS = {qtype: (576, 1536) if qtype not in (Q.Q4_K, Q.Q5_K, Q.Q6_K) else (256, 1536) for qtype in QTYPES}


def layouts(qtype):
    yield "gguf", lambda blocks: blocks, int(qtype)
    if qtype in OCTET_MAJOR_TYPES:
        yield "octet-major", lambda b: torch.ops.carpool.ggml_octet_major(b, int(qtype)), int(qtype) | OCTET_MAJOR
    if qtype in (Q.Q4_K, Q.Q6_K):
        yield "row groups", lambda b: torch.ops.carpool.ggml_row_groups(b, int(qtype)), int(qtype) | ROW_GROUPS


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=("fp32", "bf16"))
@pytest.mark.parametrize("qtype", QTYPES, ids=lambda t: t.name)
def test_a_rows_bits_do_not_depend_on_how_many_rows_share_its_call(every_row_count_int8, qtype, dtype):
    for cols in WIDTHS[qtype]:
        blocks, _ = random_blocks(40, cols, qtype, seed=cols)  # 40 outputs: five row groups, a partial panel
        x = torch.randn(max(ROWS), cols, generator=torch.Generator().manual_seed(cols)).to(dtype)
        x[7] *= 300  # each row quantizes by its own scales
        for name, arrange, flagged in layouts(qtype):
            weights = arrange(blocks)
            alone = torch.cat([torch.ops.carpool.ggml_linear(x[m : m + 1], weights, flagged) for m in range(40)])
            for rows in ROWS:
                out = torch.ops.carpool.ggml_linear(x[:rows], weights, flagged)
                same = (
                    out[:40].view(torch.int16 if dtype == torch.bfloat16 else torch.int32)
                    == alone[:rows].view(torch.int16 if dtype == torch.bfloat16 else torch.int32)
                ).all(-1)
                assert same.all(), f"{name}, {cols} wide, {rows} rows: rows {(~same).nonzero().flatten().tolist()}"
