"""Running test files on every kernel path this CPU can run, not only the one this process loaded: a process loads
one kernel build, so each other path runs them in a fresh interpreter with CARPOOL_KERNEL_ISA naming it, and with
torch's own kernels at the matching capability (ATEN_CPU_CAPABILITY), as on a CPU whose best path that is."""

import os
import subprocess
import sys
from pathlib import Path

from carpool.kernels import kernel_path, runnable_paths
from carpool.kernels.isa import TORCH_CAPABILITY

ROOT = Path(__file__).parent.parent
OTHER_PATHS = [path for path in runnable_paths() if path != kernel_path()]


def run_on_path(path: str, test_files: list[str], timeout: float, *pytest_args: str) -> None:
    """Run pytest on test_files with the kernels of `path`; fails with the output's tail unless they pass."""
    env = {**os.environ, "CARPOOL_KERNEL_ISA": path, "ATEN_CPU_CAPABILITY": TORCH_CAPABILITY[path]}
    check = "import carpool.kernels as k, torch; print(k.kernel_path(), torch.backends.cpu.get_cpu_capability())"
    loaded = subprocess.run([sys.executable, "-c", check], env=env, capture_output=True, text=True, timeout=120)
    assert loaded.stdout.split() == [path, TORCH_CAPABILITY[path].upper()], loaded.stderr
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *pytest_args, *test_files],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
    )
    assert result.returncode == 0, f"{path} path:\n{result.stdout[-4000:]}{result.stderr[-2000:]}"
