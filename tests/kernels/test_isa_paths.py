"""The kernel tests on every path this machine can run, not only the one this process loaded.

A process loads one kernel build, so each other path runs the kernel test files in a fresh interpreter with
CARPOOL_KERNEL_ISA naming it, and with torch's own kernels at the matching capability (ATEN_CPU_CAPABILITY), as on
a CPU whose best path that is: silu_mul's bit-for-bit comparison with torch holds only then.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from carpool.kernels import built_paths, cpu_features, kernel_path, refused_paths
from carpool.kernels.isa import PATHS, TORCH_CAPABILITY, missing_features

HERE = Path(__file__).parent
NOT_KERNEL_TESTS = {Path(__file__).name, "test_kernel_choice.py"}  # this file, and tests of the choice itself
KERNEL_TESTS = sorted(str(p) for p in HERE.glob("test_*.py") if p.name not in NOT_KERNEL_TESTS)
RUNNABLE_PATHS = [
    path
    for path in PATHS
    if path in built_paths() and not missing_features(path, cpu_features()) and path not in refused_paths()
]
OTHER_PATHS = [path for path in RUNNABLE_PATHS if path != kernel_path()]


@pytest.mark.parametrize("path", OTHER_PATHS)
def test_kernel_tests_pass_on_every_path_this_cpu_runs(path):
    env = {**os.environ, "CARPOOL_KERNEL_ISA": path, "ATEN_CPU_CAPABILITY": TORCH_CAPABILITY[path]}
    check = "import carpool.kernels as k, torch; print(k.kernel_path(), torch.backends.cpu.get_cpu_capability())"
    loaded = subprocess.run([sys.executable, "-c", check], env=env, capture_output=True, text=True, timeout=120)
    assert loaded.stdout.split() == [path, TORCH_CAPABILITY[path].upper()], loaded.stderr
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *KERNEL_TESTS],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        cwd=HERE.parent.parent,
    )
    assert result.returncode == 0, f"{path} path:\n{result.stdout[-4000:]}{result.stderr[-2000:]}"
