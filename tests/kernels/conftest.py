import pytest
import torch
from test_ggml_quants import QTYPES

from carpool.models.quantization import set_matmul_mode


@pytest.fixture
def every_row_count_int8():
    """int8-dot mode with every format's row limit raised, so each row count takes the integer kernels (the GEMV or
    the batched kernel) rather than the exact path; the thread's mode and the limits are restored after."""
    previous_mode = set_matmul_mode("int8-dot")
    previous = {qtype: torch.ops.carpool.set_int8_dot_max_rows(int(qtype), 1 << 20) for qtype in QTYPES}
    yield
    for qtype, rows in previous.items():
        torch.ops.carpool.set_int8_dot_max_rows(int(qtype), rows)
    set_matmul_mode(previous_mode)
