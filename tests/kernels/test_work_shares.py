"""WorkShares (kernels/csrc/work_shares.h), how the fused decode step's projections and the GEMV's rows are shared
over threads: every unit runs exactly once, and the units a slow thread has not started are taken on by the others.
torch.ops.carpool.work_shares_trace runs it on units that record who ran them, thread 0 sleeping per unit."""

import pytest
import torch

import carpool.kernels  # noqa: F401  (loads torch.ops.carpool)


@pytest.mark.parametrize("units,threads", [(0, 2), (1, 2), (2, 2), (7, 3), (40, 2), (257, 4), (5, 1)])
def test_every_unit_runs_exactly_once(units, threads):
    runs, _ = torch.ops.carpool.work_shares_trace(units, threads, 0)
    assert runs.tolist() == [1] * units


@pytest.mark.parametrize("threads", [2, 3])
def test_a_slow_threads_units_are_taken_on(threads):
    units = 16 * threads
    # Thread 0's own share is units [0, 16); alone, at 5 ms a unit, it would take 80 ms. The others finish their
    # shares at once and take the back half of its rest, again and again.
    runs, ran_by = torch.ops.carpool.work_shares_trace(units, threads, 5000)
    assert runs.tolist() == [1] * units
    assert int((ran_by[:16] != 0).sum()) >= 8


def test_bad_arguments_are_refused():
    with pytest.raises(RuntimeError, match="threads"):
        torch.ops.carpool.work_shares_trace(4, 0, 0)
    with pytest.raises(RuntimeError, match="units"):
        torch.ops.carpool.work_shares_trace(-1, 2, 0)
