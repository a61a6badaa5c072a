"""Greedy tokens from bf16 logits, side by side in one run: widening them to fp32 and taking max's indices (what
the sampler did) against `torch.ops.carpool.row_argmax` on the logits as they are, and the widening alone.

    python -m carpool.bench.greedy [--rows 1 32] [--vocab 151936] [--threads 2]

Milliseconds per call, the fastest of 7 rounds with the candidates taking turns (`gemv.seconds_per_call`), after
checking that both give the same tokens.
"""

import argparse

import torch

import carpool.kernels  # noqa: F401  (registers torch.ops.carpool)
from carpool.bench.gemv import seconds_per_call


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 32], help="logits rows (sequences sampling)")
    parser.add_argument("--vocab", type=int, default=151_936, help="vocabulary (default: Qwen2.5's)")
    parser.add_argument("--threads", type=int, nargs="+", default=[torch.get_num_threads()])
    args = parser.parse_args(argv)
    print("| threads | rows | widen + max (ms) | row_argmax (ms) | speed-up | widen alone (ms) |")
    print("| --- | --- | --- | --- | --- | --- |")
    for threads in args.threads:
        torch.set_num_threads(threads)
        for rows in args.rows:
            logits = torch.randn(rows, args.vocab).bfloat16()
            if not torch.equal(torch.ops.carpool.row_argmax(logits), logits.float().max(dim=-1).indices):
                raise RuntimeError(f"row_argmax disagrees with max's indices at {rows} rows, {threads} threads")
            times = seconds_per_call(
                {
                    "widen + max": lambda: logits.float().max(dim=-1).indices,
                    "row_argmax": lambda: torch.ops.carpool.row_argmax(logits),
                    "widen": logits.float,
                }
            )
            ms = {name: t * 1e3 for name, t in times.items()}
            print(
                f"| {threads} | {rows} | {ms['widen + max']:.3f} | {ms['row_argmax']:.3f} | "
                f"{ms['widen + max'] / ms['row_argmax']:.1f}x | {ms['widen']:.3f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
