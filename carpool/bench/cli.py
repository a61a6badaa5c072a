"""`carpool bench MODE`: each benchmark module adds its own mode to this group."""

from carpool.bench import (
    batch,
    cache_ttl,
    compression,
    day,
    ledger_replay,
    offline,
    prefill,
    prefix,
    replicas,
    reproducible,
    serve,
    simulate_day,
    soak,
    spec,
    structured,
    trace,
)

MODES = (
    offline.add_parser,
    serve.add_parser,
    prefill.add_parser,
    prefix.add_parser,
    batch.add_parser,
    structured.add_parser,
    spec.add_parser,
    trace.add_parser,
    compression.add_parser,
    replicas.add_parser,
    simulate_day.add_parser,  # `carpool bench simulate`, with its --day
    soak.add_parser,
    cache_ttl.add_parser,
    ledger_replay.add_parser,
    day.add_parser,
    reproducible.add_parser,
)


def add_bench_parser(subparsers) -> None:
    parser = subparsers.add_parser("bench", help="benchmarks against the tools users would pick instead")
    modes = parser.add_subparsers(dest="bench_mode", required=True, metavar="MODE")
    for add_mode in MODES:
        add_mode(modes)
