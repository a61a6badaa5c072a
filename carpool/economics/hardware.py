"""What this machine can do at best: memory bandwidth (a large tensor copy) and fp32 matmul FLOP/s.

These set the floors a decode step is compared with. The engine computes in fp32, so fp32 is measured.
Each figure is the best of a few runs: the floor is what the hardware can do, not what it did on average.
"""

import time
from dataclasses import dataclass

import torch

_SIZES = {  # device type -> (bytes copied, matmul side): large enough to defeat caches, small enough to be quick
    "cpu": (256 * 2**20, 2048),
    "cuda": (2 * 2**30, 8192),
}


@dataclass(frozen=True)
class Hardware:
    device: str
    memory_bandwidth: float  # bytes/s, reads plus writes
    flops: float  # fp32 matmul FLOP/s


def measure_hardware(device: str | None = None, repeats: int = 5) -> Hardware:
    target = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    copy_bytes, side = _SIZES.get(target.type, _SIZES["cpu"])
    return Hardware(
        device=str(target),
        memory_bandwidth=measure_bandwidth(target, copy_bytes, repeats),
        flops=measure_flops(target, side, repeats),
    )


def measure_bandwidth(device: torch.device, num_bytes: int, repeats: int) -> float:
    source = torch.ones(num_bytes // 4, dtype=torch.float32, device=device)
    target = torch.empty_like(source)
    seconds = _best_time(lambda: target.copy_(source), device, repeats)
    return 2 * num_bytes / seconds  # every byte is read once and written once


def measure_flops(device: torch.device, side: int, repeats: int) -> float:
    a = torch.randn(side, side, dtype=torch.float32, device=device)
    b = torch.randn(side, side, dtype=torch.float32, device=device)
    seconds = _best_time(lambda: torch.mm(a, b), device, repeats)
    return 2 * side**3 / seconds


def _best_time(work, device: torch.device, repeats: int) -> float:
    work()  # warm-up: allocator, kernels, page faults
    best = float("inf")
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        work()
        _sync(device)
        best = min(best, time.perf_counter() - start)
    return best


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
