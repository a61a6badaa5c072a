"""Kernel micro-benchmark: ggml_linear's exact path against its integer kernels side by side in one run (the machine
may be shared: compare the ratio, not the absolute figures), at decode's activation rows or a prompt chunk's.

    python -m carpool.bench.gemv [--model qwen2.5-coder-1.5b] [--rows 1 4 8 16 32 64] [--threads 1 2] [--cpu-time]
    python -m carpool.bench.gemv --model smollm2-135m --layouts [--copies 20] [--rows 1 4 8 32] [--threads 1]

The int8 column runs matmul "int8-dot-all": the integer kernels at every row count (the GEMV up to 5 rows, the
batched kernel above); "int8-dot" says which of the two the default mode runs at that count in this build
(torch.ops.carpool.int8_dot_max_rows; prompt chunks above it stay exact). --cpu-time times the calling thread's CPU
time instead of the wall clock: steadier on a loaded machine, meaningful at 1 thread only.

Each block format the model's GGUF file holds comes from it (its largest matrix of that format: Qwen2.5-Coder-1.5B's
Q4_K and Q6_K, SmolLM2's Q4_1 and its Q8_0 embedding, which is also its LM head); the other 32-weight formats (Q4_0,
Q4_1, Q5_0, Q8_0) are the largest layer matrix's shape quantized by gguf-py. Each runs in the layout the loader gives
it on this kernel path (Q4_0/Q4_1 octet-major on OCTET_MAJOR_PATHS, Q4_K and Q6_K in row groups on
ROW_GROUP_PATHS). GB/s counts the weight blocks one call streams.
Then the error of one int8 call against the exact path.

--layouts instead times the matrices carpool rearranges in GGUF's layout against their arrangement (Q4_0/Q4_1
octet-major, Q4_K and Q6_K in row groups; kernels/csrc/ggml_blocks.h), side by side in both modes, whatever this
path's loader picks: the measurement behind OCTET_MAJOR_PATHS and ROW_GROUP_PATHS. --copies cycles that many copies
of each matrix, so that a call reads its weights from memory rather than a warm cache, as a decode step's do.
"""

import argparse
import functools
import itertools
import time

import gguf
import numpy as np
import torch

from carpool.kernels import kernel_path
from carpool.models.catalog import model_path
from carpool.models.quantization import ARRANGEMENTS, GGMLWeight, set_matmul_mode

Q = gguf.GGMLQuantizationType
COMPARED = ("exact", "int8-dot-all")
FILE_TYPES = (Q.Q4_K, Q.Q5_K, Q.Q6_K)
QUANTIZED_TYPES = (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q8_0)


def weights(model: str) -> dict:
    """qtype -> uint8 blocks [rows, bytes]: the file's largest matrix of each block format (the token embedding only
    where the LM head reads it, as SmolLM2 ties them), and the largest layer matrix's shape quantized by gguf-py in
    the 32-weight formats the file lacks."""
    reader = gguf.GGUFReader(model_path(model))
    tied = all(t.name != "output.weight" for t in reader.tensors)
    found, largest = {}, None
    for tensor in reader.tensors:
        if tensor.tensor_type not in (*FILE_TYPES, *QUANTIZED_TYPES) or len(tensor.shape) != 2:
            continue
        if tensor.name == "token_embd.weight" and not tied:
            continue
        size = (int(tensor.n_elements), int(tensor.shape[1]))  # ties go to the more rows: an up projection
        if tensor.tensor_type not in found or size > found[tensor.tensor_type][0]:
            found[tensor.tensor_type] = (size, tensor)
        if tensor.name.startswith("blk.") and (largest is None or size > largest[0]):
            largest = (size, tensor)
    out = {qtype: torch.from_numpy(np.array(t.data)) for qtype, (_, t) in found.items()}
    cols, rows = (int(n) for n in largest[1].shape)
    dense = np.random.default_rng(0).standard_normal((rows, cols)).astype(np.float32) * 0.02
    for qtype in QUANTIZED_TYPES:
        if qtype not in out:
            out[qtype] = torch.from_numpy(np.ascontiguousarray(gguf.quants.quantize(dense, qtype)))
    return out


def seconds_per_call(calls: dict, min_time: float = 0.1, rounds: int = 7, clock=time.perf_counter) -> dict:
    """name -> the fastest seconds per call over `rounds`, the candidates taking turns so both see the same load."""
    counts = {}
    for name, fn in calls.items():
        fn()
        start, n = clock(), 0
        while clock() - start < 0.02:
            fn()
            n += 1
        counts[name] = max(1, int(n * min_time / 0.02))
    best = dict.fromkeys(calls, float("inf"))
    for _ in range(rounds):
        for name, fn in calls.items():
            start = clock()
            for _ in range(counts[name]):
                fn()
            best[name] = min(best[name], (clock() - start) / counts[name])
    return best


def linear(mode: str, x: torch.Tensor, blocks: torch.Tensor, qtype: int) -> torch.Tensor:
    set_matmul_mode(mode)
    return torch.ops.carpool.ggml_linear(x, blocks, qtype)


def cycled_linear(mode: str, x: torch.Tensor, copies: list[GGMLWeight]):
    """A call that runs `linear` on the next of `copies` each time."""
    turn = itertools.cycle(copies)

    def call():
        weight = next(turn)
        return linear(mode, x, weight.data, weight.kernel_qtype)

    return call


def compare_layouts(blocks: dict, args, clock) -> None:
    """Each format carpool rearranges (Q4_0/Q4_1 octet-major, Q4_K and Q6_K in row groups) in GGUF's layout against
    its arrangement, each mode's two layouts taking turns."""
    print(
        "| format | shape | threads | rows | mode | GGUF | rearranged | speed-up |\n"
        "| --- | --- | --- | --- | --- | --- | --- | --- |"
    )
    for qtype in sorted(set(blocks) & set(ARRANGEMENTS)):
        gguf_rows = [GGMLWeight(qtype, blocks[qtype].clone()) for _ in range(args.copies)]
        rearranged = [w.arranged(ARRANGEMENTS[qtype]) for w in gguf_rows]
        out_features, cols = gguf_rows[0].shape
        name = f"{qtype.name} ({ARRANGEMENTS[qtype]})"
        for threads in args.threads:
            torch.set_num_threads(threads)
            for rows, mode in itertools.product(args.rows, COMPARED):
                x = torch.randn(rows, cols).to(getattr(torch, args.dtype))
                times = seconds_per_call(
                    {"gguf": cycled_linear(mode, x, gguf_rows), "rearranged": cycled_linear(mode, x, rearranged)},
                    clock=clock,
                )
                cells = " | ".join(f"{blocks[qtype].numel() / t / 1e9:.1f} ({t * 1e3:.3f})" for t in times.values())
                print(
                    f"| {name} | {out_features}x{cols} | {threads} | {rows} | {mode} | {cells} | "
                    f"{times['gguf'] / times['rearranged']:.2f}x |",
                    flush=True,
                )
    set_matmul_mode("exact")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-coder-1.5b")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 16, 32, 64])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--cpu-time", action="store_true", help="time thread CPU time (1 thread) not wall time")
    parser.add_argument("--layouts", action="store_true", help="GGUF's layout against carpool's arrangements")
    parser.add_argument("--copies", type=int, default=1, help="with --layouts: copies of each matrix, cycled")
    args = parser.parse_args()
    clock = time.thread_time if args.cpu_time else time.perf_counter
    print(
        f"kernel path {kernel_path()}, {args.dtype} activations, {'CPU' if args.cpu_time else 'wall'} time; "
        "GB/s of weight blocks (ms per call)"
    )
    if args.layouts:
        return compare_layouts(weights(args.model), args, clock)
    blocks = {qtype: GGMLWeight(qtype, data).for_kernels() for qtype, data in weights(args.model).items()}
    print("| format | shape | threads | rows | " + " | ".join(COMPARED) + " | speed-up | int8-dot |")
    print("| --- | --- | --- | --- | " + " | ".join("---" for _ in COMPARED) + " | --- | --- |")
    for qtype, weight in sorted(blocks.items()):
        data, cols = weight.data, weight.shape[1]
        name = qtype.name + (f" {weight.layout}" if weight.layout != "gguf" else "")
        for threads in args.threads:
            torch.set_num_threads(threads)
            for rows in args.rows:
                x = torch.randn(rows, cols).to(getattr(torch, args.dtype))
                default = "int8" if rows <= torch.ops.carpool.int8_dot_max_rows(int(qtype)) else "exact"
                times = seconds_per_call(
                    {mode: functools.partial(linear, mode, x, data, weight.kernel_qtype) for mode in COMPARED},
                    clock=clock,
                )
                cells = " | ".join(f"{data.numel() / t / 1e9:.1f} ({t * 1e3:.3f})" for t in times.values())
                print(
                    f"| {name} | {data.shape[0]}x{cols} | {threads} | {rows} | {cells} | "
                    f"{times['exact'] / times['int8-dot-all']:.2f}x | {default} |",
                    flush=True,
                )
    print(
        "\nint8 against exact, fp32 rows of N(0, 1) activations (1 row: the GEMV, 32 and 512: the batched kernel): "
        "max |error| / max |y|, rms error / rms y"
    )
    print("| format | rows | max | rms |\n| --- | --- | --- | --- |")
    for qtype, weight in sorted(blocks.items()):
        for rows in (1, 32, 512):
            x = torch.randn(rows, weight.shape[1])
            exact, fast = (linear(mode, x, weight.data, weight.kernel_qtype) for mode in COMPARED)
            error = fast - exact
            print(
                f"| {qtype.name} | {rows} | {(error.abs().max() / exact.abs().max()).item():.2e} | "
                f"{(error.norm() / exact.norm()).item():.2e} |"
            )
    set_matmul_mode("exact")


if __name__ == "__main__":
    main()
