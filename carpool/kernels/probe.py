"""What carpool's kernels see on this machine: `python -m carpool.kernels.probe` (also `carpool info`).

Prints the CPU, the features that decide a kernel path, the AMX probe's result, every path with whether this
install built it and this CPU runs it, and the path this process chose.
"""

import platform

import torch

from carpool.kernels import (
    RELEVANT_FEATURES,
    amx_probe,
    built_paths,
    cpu_features,
    cpu_model,
    kernel_path,
    refused_paths,
)
from carpool.kernels.isa import ENV_VAR, PATHS, forced_path, missing_features


def describe() -> str:
    features = cpu_features()
    built = built_paths()
    probe = amx_probe()
    lines = [
        f"CPU: {cpu_model()} ({platform.machine()})",
        "features: " + " ".join(f"{name}{'' if name in features else ' (no)'}" for name in RELEVANT_FEATURES),
        f"AMX probe: {'works' if probe.usable else 'unavailable'}: {probe.detail}",
    ]
    refused = refused_paths()
    for path in PATHS:
        missing = missing_features(path, features)
        state = (
            "not built"
            if path not in built
            else f"CPU lacks {', '.join(missing)}"
            if missing
            else refused.get(path, "runs here")
        )
        lines.append(f"path {path}: {state}{'  <- chosen' if path == kernel_path() else ''}")
    how = f"forced by {ENV_VAR}" if forced_path() else f"the best this CPU runs; {ENV_VAR}=<path> forces one"
    lines.append(f"kernel path: {kernel_path()} ({how})")
    lines.append(f"torch's own CPU kernels: {torch.backends.cpu.get_cpu_capability()}")
    return "\n".join(lines)


def add_info_parser(subparsers) -> None:
    parser = subparsers.add_parser("info", help="the CPU, its features, the AMX probe and the kernel path chosen")
    parser.set_defaults(func=lambda args: print(describe()))


if __name__ == "__main__":
    print(describe())
