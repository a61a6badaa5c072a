"""The kernel tests on every path this machine can run, not only the one this process loaded (kernel_paths.py:
each in a fresh interpreter with CARPOOL_KERNEL_ISA naming it and torch's own kernels at the matching capability,
as on a CPU whose best path that is: silu_mul's bit-for-bit comparison with torch holds only then)."""

from pathlib import Path

import pytest
from kernel_paths import OTHER_PATHS, run_on_path

HERE = Path(__file__).parent
NOT_KERNEL_TESTS = {Path(__file__).name, "test_kernel_choice.py"}  # this file, and tests of the choice itself
KERNEL_TESTS = sorted(str(p) for p in HERE.glob("test_*.py") if p.name not in NOT_KERNEL_TESTS)


@pytest.mark.parametrize("path", OTHER_PATHS)
def test_kernel_tests_pass_on_every_path_this_cpu_runs(path):
    run_on_path(path, KERNEL_TESTS, timeout=600)
