"""Dollars in refusals are printed to the precision that keeps them true: four significant digits, at least cents."""

import pytest

from carpool.economics.budget import dollars


@pytest.mark.parametrize(
    ("amount", "printed"),
    [
        (0.00006, "$0.00006"),  # not $0.0001, which reads as more than a key spent against it
        (0.000412345, "$0.0004123"),
        (0.0018, "$0.0018"),
        (5, "$5.00"),
        (1.23456, "$1.235"),
        (1234.5, "$1234.50"),
        (0, "$0.00"),
    ],
)
def test_dollars_keep_four_significant_digits(amount, printed):
    assert dollars(amount) == printed
