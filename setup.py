"""Builds carpool's C++ CPU kernels (torch extensions) at install; everything else is in pyproject.toml."""

import importlib.util
import os
import platform
import subprocess
import sysconfig
import tempfile
from pathlib import Path

from setuptools import Extension, setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

CSRC = Path("carpool/kernels/csrc")
FEATURE_PROBE = CSRC / "cpu_features.cpp"  # its own module: it must load on every CPU, before any kernels
KERNEL_SOURCES = sorted(str(p) for p in CSRC.glob("*.cpp") if p != FEATURE_PROBE)

# The same kernels once per instruction-set path, so one build serves every x86-64 CPU: carpool.kernels picks
# at import the best one the CPU has all the features of (carpool/kernels/isa.py lists them per path).
# x86-64-v4 is AVX-512 F/BW/CD/DQ/VL (with v3's AVX2, FMA, F16C); v3 is AVX2, FMA, F16C, BMI; plain x86-64 is
# SSE2; amx adds the tile instructions to avx512 (its module loads only where the AMX probe ran a tile multiply),
# avxvnni AVX-VNNI's 256-bit vpdpbusd to avx2 (Intel client chips from Alder Lake on, which have no AVX-512).
# Elsewhere (aarch64) only the portable build, for whatever the compiler's default target is.
if platform.machine().lower() in ("x86_64", "amd64"):
    AVX512 = ["-march=x86-64-v4", "-mavx512bf16", "-mavx512vnni"]
    ISA_FLAGS = {
        "amx": [*AVX512, "-mamx-tile", "-mamx-bf16"],
        "avx512": AVX512,
        "avxvnni": ["-march=x86-64-v3", "-mavxvnni"],
        "avx2": ["-march=x86-64-v3"],
        "portable": ["-march=x86-64"],
    }
else:
    ISA_FLAGS = {"portable": []}

# CARPOOL_KERNEL_ISAS=avx512[,avx2,...] builds only those paths, and CARPOOL_KERNEL_ISAS=native only the one this
# CPU runs (`make serve`: one path compiles in about a fifth of the time of all five, so a fresh machine answers its
# first request minutes sooner). With no value every path is built (`make test`, which forces each path; a wheel
# for other machines). The other paths' modules stay as they were, stale, until a build without it.
ISAS_ENV = "CARPOOL_KERNEL_ISAS"


def native_paths() -> list[str]:
    """The best path whose every feature /proc/cpuinfo lists (the names carpool/kernels/isa.py checks at import).
    At import amx must also pass a tile multiply (some VMs list AMX and fault on it): amx alone where the probe,
    built here first, runs one now, else avx512, or both where the probe cannot be built. Every path where
    /proc/cpuinfo cannot be read (not Linux)."""
    spec = importlib.util.spec_from_file_location("carpool_isa", Path("carpool/kernels/isa.py"))
    isa = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(isa)  # the table alone: importing carpool.kernels needs the modules this builds
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        return list(ISA_FLAGS)
    features = set(flags.partition(":")[2].split())
    # cpuinfo's own spellings of two features (the CPUID probe, csrc/cpu_features.cpp, uses the plain names)
    features |= {plain for plain, listed in (("sse3", "pni"), ("lzcnt", "abm")) if listed in features}
    best = next(path for path in ISA_FLAGS if not isa.missing_features(path, features))
    if best != "amx":
        return [best]
    works = tile_multiply_works()
    return ["amx", "avx512"] if works is None else ["amx"] if works else ["avx512"]


def tile_multiply_works() -> bool | None:
    """The AMX probe of carpool/kernels/cpu.py, on a copy of the feature module compiled now (half a second);
    None where it cannot be compiled or loaded. Building one path instead of two saves about 2.5 minutes of a
    fresh `make serve` on 2 cores (2026-12-06: the two paths compiled in 5 min 18 s)."""
    with tempfile.TemporaryDirectory() as folder:
        module = Path(folder) / f"_cpu_features{sysconfig.get_config_var('EXT_SUFFIX')}"
        compiler = os.environ.get("CXX", "c++")
        command = [compiler, "-O2", "-std=c++20", "-shared", "-fPIC", f"-I{sysconfig.get_paths()['include']}"]
        try:
            subprocess.run([*command, str(FEATURE_PROBE), "-o", str(module)], check=True, capture_output=True)
            spec = importlib.util.spec_from_file_location("_cpu_features", module)
            probe = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(probe)
        except (OSError, subprocess.CalledProcessError, ImportError):
            return None
        return probe.request_tile_permission() is None and probe.tile_multiply_in_child() is None


if os.environ.get(ISAS_ENV, "").strip():
    chosen = [name.strip() for name in os.environ[ISAS_ENV].split(",") if name.strip()]
    if chosen == ["native"]:
        chosen = native_paths()
    unknown = [name for name in chosen if name not in ISA_FLAGS]
    if unknown:
        raise ValueError(
            f"{ISAS_ENV}: unknown kernel path(s) {', '.join(unknown)} (choose from native, {', '.join(ISA_FLAGS)})"
        )
    ISA_FLAGS = {isa: flags for isa, flags in ISA_FLAGS.items() if isa in chosen}

# -ffp-contract=off: no silent FMA contraction, so the portable loops round where gguf-py and torch round.
COMMON_FLAGS = ["-O3", "-ffp-contract=off", "-fopenmp", "-std=c++20"]


# Objects live here, not in the temporary folder `pip install -e` gives each build: with torch's ninja backend
# (used wherever a `ninja` executable is on PATH) a rebuild then recompiles only the sources (and their headers'
# dependents) that changed since the last one.
OBJECTS = Path(__file__).resolve().parent / "build" / "kernels"


class BuildEachIsaApart(BuildExtension):
    """One object folder per extension: the ISA builds compile the same sources with different flags, and a
    shared folder would make each build overwrite (and then recompile) the previous one's objects."""

    def build_extension(self, ext):
        shared, self.build_temp = self.build_temp, str(OBJECTS / ext.name)
        try:
            super().build_extension(ext)
        finally:
            self.build_temp = shared


setup(
    ext_modules=[
        Extension("carpool.kernels._cpu_features", [str(FEATURE_PROBE)], extra_compile_args=["-O2", "-std=c++20"]),
        *(
            CppExtension(
                f"carpool.kernels._C_{isa}",
                KERNEL_SOURCES,
                extra_compile_args=[*COMMON_FLAGS, *flags],
                extra_link_args=["-fopenmp"],
            )
            for isa, flags in ISA_FLAGS.items()
        ),
    ],
    cmdclass={"build_ext": BuildEachIsaApart},
)
