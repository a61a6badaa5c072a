"""The batch-steps bench times steps of exactly each requested size and leaves the engine empty."""

import pytest

from carpool.bench.batch_steps import run


def test_each_size_is_timed_on_steps_of_that_many_sequences():
    report = run("smollm2-135m", sizes=[3, 5, 1], steps=2, threads=1, context=20)
    assert [row["size"] for row in report["sizes"]] == [5, 3, 1]  # largest first, then aborted down
    for row in report["sizes"]:
        assert row["step_ms"] > 0 and row["ms_per_sequence"] == pytest.approx(row["step_ms"] / row["size"])


def test_sizes_are_checked():
    with pytest.raises(ValueError, match="sizes"):
        run("smollm2-135m", sizes=[0, 4], steps=1, threads=1, context=20)
