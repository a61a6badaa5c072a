"""carpool's C++ CPU kernels, registered as `torch.ops.carpool.*` when this package is imported.

setup.py builds the same sources (csrc/) once per instruction-set path: `_C_avx512` (AVX-512 with BF16 and
VNNI), `_C_avx2` (AVX2, FMA, F16C) and `_C_portable` (plain x86-64, or whatever the platform is). Each one
registers the same ops, so a process loads exactly one: the best the CPU has every feature of (isa.py), or the
one `CARPOOL_KERNEL_ISA=avx512|avx2|portable` names, which is an error if this CPU cannot run it.
"""

import importlib
import importlib.util
import logging

from carpool.kernels.cpu import AMX_FEATURES, amx_probe, cpu_features, cpu_model
from carpool.kernels.isa import PATHS, choose_path, forced_path

__all__ = ["RELEVANT_FEATURES", "amx_probe", "built_paths", "cpu_features", "cpu_model", "kernel_path"]

logger = logging.getLogger(__name__)

# What decides a path, for logs and `carpool info`.
RELEVANT_FEATURES = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_bf16", "avx512_vnni", *AMX_FEATURES)


def built_paths() -> set[str]:
    """The kernel paths this install compiled (only the portable one off x86-64)."""
    return {path for path in PATHS if importlib.util.find_spec(f"carpool.kernels._C_{path}") is not None}


_choice = choose_path(cpu_features(), built_paths(), forced_path())
importlib.import_module(f"carpool.kernels._C_{_choice.path}")


def kernel_path() -> str:
    """The instruction-set path this process's kernels run on: avx512, avx2 or portable."""
    return _choice.path


logger.info(
    "carpool kernels: %s path (%s) on %s; features: %s; AMX: %s",
    _choice.path,
    "forced by CARPOOL_KERNEL_ISA" if _choice.forced else "the best this CPU runs",
    cpu_model(),
    " ".join(name for name in RELEVANT_FEATURES if name in cpu_features()) or "none of " + ", ".join(RELEVANT_FEATURES),
    amx_probe().detail + (" (carpool has no AMX kernels yet)" if amx_probe().usable else ""),
)
