"""The CPU as the kernels see it: its model, the features it has, and whether its AMX tile units really work.

Read through `_cpu_features`, a tiny module with no torch and no -march that loads on every CPU.
"""

import platform
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from carpool.kernels import _cpu_features

AMX_FEATURES = ("amx_tile", "amx_bf16", "amx_int8")


@dataclass(frozen=True)
class AmxProbe:
    usable: bool
    detail: str  # what was found: the missing feature, the refused permission, the fault, or success


@cache
def cpu_features() -> frozenset[str]:
    """x86 features the CPU lists and the OS enables (/proc/cpuinfo's names); empty on other architectures."""
    return frozenset(_cpu_features.features())


@cache
def cpu_model() -> str:
    """The brand string with CPUID's family and model: 'AMD EPYC (family 25, model 17, stepping 1)'."""
    model = _cpu_features.cpu_model().strip()
    signature = _cpu_features.cpu_signature()
    if model and signature:
        return "{} (family {}, model {}, stepping {})".format(model, *signature)
    if model:
        return model
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith(("model name", "cpu model")):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


@cache
def amx_probe() -> AmxProbe:
    """Whether bf16 tile multiplies run here. CPUID, XCR0 and the kernel's permission can all say yes on a VM
    whose hypervisor then faults on ldtilecfg or tilezero, so the last word is a tile multiply in a forked
    child. Asking for the permission is also what lets this process use the tiles afterwards."""
    missing = [name for name in AMX_FEATURES if name not in cpu_features()]
    if missing:
        return AmxProbe(False, f"CPU does not list {', '.join(missing)} (or the OS does not enable tile state)")
    refused = _cpu_features.request_tile_permission()
    if refused:
        return AmxProbe(False, refused)
    failed = _cpu_features.tile_multiply_in_child()
    if failed:
        return AmxProbe(False, failed)
    return AmxProbe(True, "a bf16 tile multiply ran and was right")
