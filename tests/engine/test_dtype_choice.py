"""`--dtype auto` follows the kernel path that runs, not only what the CPU lists: bf16 only where carpool's
kernels have bf16 dot units (the avx512 path)."""

import os
import subprocess
import sys

import torch

from carpool.engine.config import resolve_dtype
from carpool.kernels import kernel_path

CHOICE = (
    "import torch; from carpool.engine.config import resolve_dtype; print(resolve_dtype('auto', torch.device('cpu')))"
)


def test_a_path_without_bf16_units_runs_float32():
    env = {**os.environ, "CARPOOL_KERNEL_ISA": "portable"}  # every CPU can run it
    out = subprocess.run([sys.executable, "-c", CHOICE], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "torch.float32"


def test_auto_is_bfloat16_only_on_the_bf16_paths_with_onednn_bf16():
    expected = kernel_path() in ("amx", "avx512") and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    assert resolve_dtype("auto", torch.device("cpu")) == (torch.bfloat16 if expected else torch.float32)
    assert resolve_dtype("float32", torch.device("cpu")) == torch.float32
