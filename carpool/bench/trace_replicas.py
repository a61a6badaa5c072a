"""`carpool bench trace --replicas MIN:MAX`: the compressed day on replica counts (issue 52's evidence).

Four servers, in turn, every replica one thread under the SLO controller (`--slo-itl-ms priority=SLO`, the
`--large` step as its ceilings): fixed MIN, fixed MAX, autoscaled MIN:MAX (Ray Serve's autoscaler with carpool's
policy: replicas sized by their live capacity at the SLO, Batch lines taking the valleys) and the same with a
pre-warm plan. The plan is yesterday's day: the serving replicas the autoscaled run sampled in each slice (their
mean, rounded up), as `carpool capacity plan --format json` writes it (its minutes the trace's slices,
`minute_seconds`), each slice's replicas started `--replica-start-seconds` ahead. It is written when the pre-warmed run's trace starts, at
that run's clock; the server re-reads it (autoscaling.PlannedPolicy), having started with an empty one.
"""

import argparse
import json
import math
import os
import tempfile
from pathlib import Path

from carpool.server.replicas.counts import parse_replicas


def add_replica_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--replicas",
        default=None,
        metavar="MIN:MAX",
        help="compare fixed MIN, fixed MAX, autoscaled MIN:MAX and autoscaled with a pre-warm plan (1-thread "
        "replicas on Ray Serve, needs `make scale`) instead of the three step sizes",
    )
    parser.add_argument(
        "--replica-start-seconds",
        type=float,
        default=15.0,
        help="how far ahead the pre-warm plan starts a slice's replicas: a replica's load and warm-up on Ray "
        "(about 10 s measured for SmolLM2 on 2 cores; default: 15)",
    )
    parser.add_argument(
        "--scale-down-delay",
        type=float,
        default=20.0,
        help="the autoscaled servers' --scale-down-delay, seconds (default: 20, a slice)",
    )


def replica_configurations(args: argparse.Namespace, large: tuple[int, int]) -> list[dict]:
    """The four servers as the fields of carpool.bench.trace.Configuration; `large`: the ceilings, TOKENS, SEQS."""
    count = parse_replicas(args.replicas)
    if not count.autoscaled:
        raise ValueError(f"--replicas: expected MIN:MAX with MIN < MAX, got {args.replicas!r}")
    if args.replica_start_seconds < 0 or args.scale_down_delay < 0:
        raise ValueError("--replica-start-seconds and --scale-down-delay must be 0 or more")
    tokens, seqs = large
    common = [
        *("--num-threads", str(args.num_threads or 1)),
        *("--max-num-batched-tokens", str(tokens), "--max-num-seqs", str(seqs)),
        *("--slo-itl-ms", f"priority={args.slo_itl_ms:g}"),
    ]
    autoscaled = [*common, "--replicas", str(count), "--scale-down-delay", f"{args.scale_down_delay:g}"]
    plan_path = os.path.join(tempfile.mkdtemp(prefix="carpool-bench-plan-"), "plan.json")
    Path(plan_path).write_text(json.dumps({"minutes": []}))  # `carpool serve` checks the file before it starts
    prewarmed = [*autoscaled, "--capacity-plan", plan_path]
    return [
        {"name": f"fixed-{count.min}", "serve_flags": [*common, "--replicas", str(count.min)]},
        {"name": f"fixed-{count.max}", "serve_flags": [*common, "--replicas", str(count.max)]},
        {"name": "autoscaled", "serve_flags": autoscaled},
        {"name": "prewarmed", "serve_flags": prewarmed, "plan_path": plan_path, "plan_from": "autoscaled"},
    ]


def plan_document(slices: list[dict], unix_start: float, slice_seconds: float, start_seconds: float) -> dict:
    """Each slice's mean sampled replicas rounded up (a replica that served part of the slice was wanted for it),
    as a capacity plan over the trace's clock."""
    return {
        "minutes": [
            {"at": unix_start + s["index"] * slice_seconds, "replicas": math.ceil((s["replicas"] or 1) - 1e-9)}
            for s in slices
        ],
        "minute_seconds": slice_seconds,
        "replica_start_seconds": start_seconds,
    }


def write_plan(path: str, slices: list[dict], unix_start: float, args: argparse.Namespace) -> None:
    document = plan_document(slices, unix_start, args.slice_seconds, args.replica_start_seconds)
    temporary = f"{path}.tmp"
    Path(temporary).write_text(json.dumps(document))
    os.replace(temporary, path)  # whole or not at all: Ray's controller may read it at any moment
