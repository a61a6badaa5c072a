"""carpool's C++ CPU kernels, registered as `torch.ops.carpool.*` when this package is imported.

setup.py builds the same sources (csrc/) once per instruction-set path: `_C_amx` (avx512's flags and the AMX
tile instructions), `_C_avx512` (AVX-512 with BF16 and VNNI), `_C_avxvnni` (avx2's and AVX-VNNI), `_C_avx2` (AVX2,
FMA, F16C) and `_C_portable` (plain x86-64, or whatever the platform is). Each one registers the same ops, so a
process loads exactly one: the best the CPU has every feature of (isa.py; amx also needs the AMX probe's tile
multiply to have worked), or the one `CARPOOL_KERNEL_ISA=amx|avx512|avxvnni|avx2|portable` names, which is an error
if this CPU cannot run it.
"""

import importlib
import importlib.util
import logging

import torch  # noqa: F401  (the builds link torch's libraries, libc10 among them: loaded first)

from carpool.kernels.cpu import AMX_FEATURES, amx_probe, cpu_features, cpu_model
from carpool.kernels.isa import PATHS, choose_path, forced_path, missing_features

__all__ = [
    "RELEVANT_FEATURES",
    "amx_probe",
    "built_paths",
    "cpu_features",
    "cpu_model",
    "kernel_path",
    "refused_paths",
]

logger = logging.getLogger(__name__)

# What decides a path, for logs and `carpool info`.
RELEVANT_FEATURES = (
    "avx2",
    "fma",
    "f16c",
    "avx_vnni",
    "avx512f",
    "avx512bw",
    "avx512_bf16",
    "avx512_vnni",
    *AMX_FEATURES,
)


def built_paths() -> set[str]:
    """The kernel paths this install compiled (only the portable one off x86-64)."""
    return {path for path in PATHS if importlib.util.find_spec(f"carpool.kernels._C_{path}") is not None}


def refused_paths() -> dict[str, str]:
    """Paths whose features the CPU lists but which do not work here: amx where the tile multiply failed."""
    if "amx" not in built_paths() or any(name not in cpu_features() for name in AMX_FEATURES):
        return {}  # choose_path names what is missing; the probe (a fork) is not needed
    probe = amx_probe()
    return {} if probe.usable else {"amx": f"the AMX probe failed: {probe.detail}"}


def runnable_paths() -> list[str]:
    """The paths this process could have loaded here (built, the CPU's features, not refused), in PATHS' order."""
    features, refused = cpu_features(), refused_paths()
    return [p for p in PATHS if p in built_paths() and not missing_features(p, features) and p not in refused]


_choice = choose_path(cpu_features(), built_paths(), forced_path(), refused_paths())
importlib.import_module(f"carpool.kernels._C_{_choice.path}")


def kernel_path() -> str:
    """The instruction-set path this process's kernels run on: amx, avx512, avxvnni, avx2 or portable."""
    return _choice.path


logger.info(
    "carpool kernels: %s path (%s) on %s; features: %s; AMX: %s",
    _choice.path,
    "forced by CARPOOL_KERNEL_ISA" if _choice.forced else "the best this CPU runs",
    cpu_model(),
    " ".join(name for name in RELEVANT_FEATURES if name in cpu_features()) or "none of " + ", ".join(RELEVANT_FEATURES),
    amx_probe().detail,
)
