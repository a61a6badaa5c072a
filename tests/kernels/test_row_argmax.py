"""torch.ops.carpool.row_argmax (greedy tokens from the logits as they are) against max(dim=-1).indices on fp32."""

import pytest
import torch

import carpool.kernels  # noqa: F401  (registers torch.ops.carpool)
from carpool.engine.sampler import first_maxima

DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float64]


def reference(logits: torch.Tensor) -> torch.Tensor:
    return logits.double().max(dim=-1).indices


def negative_nan(dtype) -> torch.Tensor:
    """A NaN with its sign bit set (negating a NaN on the way into a tensor may not keep the sign)."""
    bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}[dtype.itemsize]
    nan = torch.tensor([float("nan")], dtype=dtype).view(bits)
    return (nan | torch.iinfo(bits).min).view(dtype)[0]


def signed_zeros(shape, generator) -> torch.Tensor:
    """Values in -3..3, many ties, with zeros of both signs (equal, so the first of them is the maximum)."""
    x = torch.randint(-3, 4, shape, generator=generator).double()
    negative = torch.rand(shape, generator=generator) < 0.5
    return torch.where((x == 0) & negative, torch.tensor(-0.0, dtype=torch.float64), x)


# 151,936: the 1.5B's vocabulary, several of the kernel's parts a row; 32,769: one element past a part; 300: one
# part, not a whole block of the second pass.
@pytest.mark.parametrize("width", [151_936, 32_769, 300, 1])
@pytest.mark.parametrize("dtype", DTYPES)
def test_first_maximum_of_each_row(dtype, width):
    generator = torch.Generator().manual_seed(width)
    x = signed_zeros((5, width), generator).to(dtype)
    x[1] = -x[1].abs()  # every value <= 0: the first zero of either sign
    x[2] = float("-inf")  # all equal: the first
    x[3, -1] = 7  # the row's only maximum, in its last element
    torch.testing.assert_close(torch.ops.carpool.row_argmax(x), reference(x), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_nan_wins_whatever_its_sign(dtype):
    generator = torch.Generator().manual_seed(1)
    x = signed_zeros((4, 70_000), generator).to(dtype)
    x[0, 50_000] = float("nan")  # after the row's maxima, in another part
    x[1, 40_000], x[1, 60_000] = negative_nan(dtype), float("nan")  # the first NaN is negative
    x[2, 0] = float("inf")
    x[2, 69_999] = float("nan")
    x[3, 5], x[3, 9] = float("inf"), float("nan")
    assert torch.signbit(x[1, 40_000])
    assert torch.ops.carpool.row_argmax(x).tolist() == [50_000, 40_000, 69_999, 9]
    assert torch.ops.carpool.row_argmax(x).tolist() == reference(x).tolist()


def test_random_logits_and_strided_rows():
    generator = torch.Generator().manual_seed(2)
    logits = torch.randn(64, 49_152, generator=generator).bfloat16()
    rows = logits[::2]  # not contiguous
    assert torch.equal(torch.ops.carpool.row_argmax(rows), reference(rows))
    assert first_maxima(rows) == reference(rows).tolist()


def test_rejects_what_is_not_rows_of_logits():
    with pytest.raises(RuntimeError, match="logits"):
        torch.ops.carpool.row_argmax(torch.zeros(3))
    with pytest.raises(RuntimeError, match="logits"):
        torch.ops.carpool.row_argmax(torch.zeros(3, 0))
