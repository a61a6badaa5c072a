"""Which build of the kernels a CPU can run.

setup.py compiles the same sources once per instruction-set path, each as its own module
(`carpool.kernels._C_<path>`); a path runs only where the CPU has every feature its compiler flags let the
compiler use, so a wheel built anywhere never dies with an illegal instruction. Best first.
"""

import os
from dataclasses import dataclass

X86_64_V2 = ("cx16", "lahf_lm", "popcnt", "sse3", "ssse3", "sse4_1", "sse4_2")
X86_64_V3 = (*X86_64_V2, "avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "lzcnt", "movbe", "xsave")
X86_64_V4 = (*X86_64_V3, "avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl")

# path -> the features its flags (setup.py's ISA_FLAGS) assume.
AVX512 = (*X86_64_V4, "avx512_bf16", "avx512_vnni")
REQUIRED_FEATURES = {
    "amx": (*AVX512, "amx_tile", "amx_bf16"),
    "avx512": AVX512,
    "avxvnni": (*X86_64_V3, "avx_vnni"),
    "avx2": X86_64_V3,
    "portable": (),
}
PATHS = tuple(REQUIRED_FEATURES)  # best first
# ATEN_CPU_CAPABILITY at which torch's own kernels run on a CPU whose best path each is: their vector width, so that
# an element-wise kernel and torch's split a row alike (silu_mul equals torch to the bit only then).
TORCH_CAPABILITY = {"amx": "avx512", "avx512": "avx512", "avxvnni": "avx2", "avx2": "avx2", "portable": "default"}
# Paths whose kernels multiply bf16 activations on bf16 units (AVX512-BF16, AMX-BF16); the others widen them to fp32.
BF16_PATHS = frozenset({"amx", "avx512"})
# Paths with a batched int8 kernel and fp32 FMAs as their exact path: prompts run faster on the int8 kernels there.
INT8_PROMPT_PATHS = frozenset({"avxvnni", "avx2"})
# Paths whose GEMV runs Q4_0/Q4_1 rows faster octet-major (kernels/csrc/ggml_blocks.h), so the loader rearranges
# them. avx2, where the GEMV is compute-bound and gathering each octet's scales was ~20 of its 69 instructions
# (Zen 3, one thread: SmolLM2's Q4_1 matrices 1.13-1.22x at 1-4 rows, the batched kernel's 8-32 rows unchanged);
# avx512, whose GEMV pairs octets as avx2's does (Zen 4, one thread, `python -m carpool.bench.gemv --layouts`: 1536x576
# at 1 row 1.18-1.20x, 2 rows 1.11-1.15x, 4 rows 1.06-1.08x, 8-32 rows 0.97-1.11x; SmolLM2's step 1.19x against the
# old 512-bit code on GGUF rows). Not measured: avxvnni (the same 256-bit VNNI code) and amx (avx512's GEMV).
OCTET_MAJOR_PATHS = frozenset({"avx2", "avx512"})
# Paths whose GEMV runs Q4_K and Q6_K matrices faster in row groups (eight rows' blocks word-interleaved,
# ggml_blocks.h), so the loader rearranges them. Zen 4, Qwen2.5-Coder-1.5B's 8960x1536 Q4_K from memory (`python -m
# carpool.bench.gemv --layouts`): avx512 1.46-1.50x at one row on one thread (1.24-1.66x on two), 1.5-1.9x at 2-5
# rows; forced avx2 1.32-1.37x at one row, 1.2-1.4x at 4-6; the batched kernel, which puts the groups back first,
# 0.93-1.05x at 16-32 rows; the 1.5B's step 1.16x (avx512) and 1.10x (avx2). Its Q6_K (LM head, ffn_down): avx512
# 1.41-1.89x at one row, 0.88-0.90x at 32 (the step 1.12x at one stream, 0.985x at 32). Not measured: avxvnni (the
# same VNNI code as avx512's) and amx, whose prompts run exact.
ROW_GROUP_PATHS = frozenset({"avx2", "avx512"})

ENV_VAR = "CARPOOL_KERNEL_ISA"


@dataclass(frozen=True)
class Choice:
    path: str
    forced: bool  # named by CARPOOL_KERNEL_ISA rather than chosen


def missing_features(path: str, features: set[str]) -> list[str]:
    return [name for name in REQUIRED_FEATURES[path] if name not in features]


def choose_path(
    features: set[str], built: set[str], forced: str | None = None, refused: dict[str, str] | None = None
) -> Choice:
    """The best built path the CPU has every feature of, or `forced` after checking the CPU can run it.

    `forced` is CARPOOL_KERNEL_ISA's value; a path the CPU cannot run or this install did not build is a
    ValueError naming what is missing rather than a crash at the first kernel call. `refused`: paths whose
    features the CPU lists but which failed a probe (amx on a VM that faults on tile instructions), with why.
    """
    refused = refused or {}
    if forced:
        if forced not in REQUIRED_FEATURES:
            raise ValueError(f"{ENV_VAR}: unknown kernel path {forced!r} (choose from {', '.join(PATHS)})")
        if forced not in built:
            raise ValueError(
                f"{ENV_VAR}: kernel path {forced!r} is not built in this install (built: "
                f"{', '.join(p for p in PATHS if p in built) or 'none'})"
            )
        missing = missing_features(forced, features)
        if missing:
            raise ValueError(f"{ENV_VAR}: this CPU cannot run the {forced} kernels, it lacks {', '.join(missing)}")
        if forced in refused:
            raise ValueError(f"{ENV_VAR}: this CPU cannot run the {forced} kernels: {refused[forced]}")
        return Choice(forced, forced=True)
    for path in PATHS:
        if path in built and not missing_features(path, features) and path not in refused:
            return Choice(path, forced=False)
    raise ValueError("no kernel build of carpool can run on this CPU (reinstall carpool to build the portable one)")


def forced_path() -> str | None:
    return os.environ.get(ENV_VAR, "").strip().lower() or None
