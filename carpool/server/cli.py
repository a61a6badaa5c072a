"""`carpool serve`: the OpenAI-compatible server on 127.0.0.1:8000 by default, for one model or several.

`--model A --model B` serves both, each with an engine and KV pool of its own; the per-model flags below are
matched to the models by position, and one value applies to every model.
"""

import argparse
import signal
import sys
import threading

from carpool.economics.cli import add_gate_args
from carpool.engine.args import add_engine_args
from carpool.engine.config import EngineConfig
from carpool.server import limits
from carpool.server.assembly import (
    build_app,
    check_prices_after_warmup,
    checked_extensions,
    meter_phases,
    model_configs,
    open_stores,
)
from carpool.server.replicas.counts import capacity_plan, replicas_arg, scale_down_delay


def add_serve_parser(subparsers) -> None:
    defaults = EngineConfig()
    # "resolve": the per-model flags below replace the single-valued ones add_engine_args defines.
    parser = subparsers.add_parser(
        "serve", help="serve the OpenAI-compatible API over HTTP", conflict_handler="resolve"
    )
    parser.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to listen on (default: 127.0.0.1, this machine only; 0.0.0.0 for every interface)",
    )
    parser.add_argument("--port", type=int, default=8000, help="TCP port (default: 8000)")
    parser.add_argument(
        "--api-key",
        action="append",
        default=[],
        help="accept only these keys, with no ledger (repeatable; default: the key store in --db, "
        "open to everyone while it holds no keys)",
    )
    parser.add_argument(
        "--max-queued-per-tier",
        type=int,
        default=limits.MAX_QUEUED_PER_TIER,
        help="requests waiting for their first token, per model and service tier, before 429s",
    )
    parser.add_argument(
        "--max-body-bytes",
        type=int,
        default=limits.MAX_BODY_BYTES,
        help=f"largest request body before a 413 (default: {limits.MAX_BODY_BYTES}; batch uploads "
        "have their own limit)",
    )
    parser.add_argument(
        "--batch-dir",
        default=None,
        help="where batches and files live, for this --db only (default: $CARPOOL_BATCH_DIR, else "
        "<db>.batches beside the database)",
    )
    parser.add_argument(
        "--no-warmup",
        action="store_true",
        help="serve at once instead of first running every step shape once (/health says "
        '"warming" until then; without it the first requests pay for the cold start)',
    )
    parser.add_argument(
        "--hourly-price",
        type=float,
        default=None,
        help="dollars an hour for the machine: once the warm-up has measured each model's decode rate, warn of every "
        "tier whose list output price is below what a token costs the machine even at full load; and /dashboard "
        "shows the margin (revenue less the machine's cost) per tier and tenant",
    )
    parser.add_argument(
        "--log-level",
        default="info",
        choices=["critical", "error", "warning", "info", "debug"],
        help="server log verbosity (default: info)",
    )
    parser.add_argument(
        "--cascades",
        default=None,
        metavar="PATH",
        help="model cascades TOML: names clients may pass as `model` that ask the served models in "
        "order, escalating when a step's answer scores below its threshold, and routers ([[router]]) that pick "
        "one model from the prompt alone (carpool.server.cascade.config and .router; `carpool cascade calibrate` "
        "fits the thresholds and the routers)",
    )
    parser.add_argument(
        "--compression-model",
        default=None,
        metavar="NAME",
        help="the served model that scores `prompt_compression` and /v1/compress (its per-token "
        "surprisal; default: the smallest served model)",
    )
    parser.add_argument(
        "--replicas",
        type=replicas_arg,
        default=None,
        metavar="N|MIN:MAX",
        help="serve each model from N engine replicas on Ray Serve behind this one endpoint, or from MIN to MAX "
        "that Ray Serve's autoscaler adds and drains on load (needs `make scale`; --num-threads is then each "
        "replica's; default: one engine in-process)",
    )
    parser.add_argument(
        "--scale-down-delay",
        type=float,
        default=None,
        metavar="SECONDS",
        help="with --replicas MIN:MAX: how long the load must stay low before a replica is drained and removed "
        "(default: 60)",
    )
    parser.add_argument(
        "--step-log",
        default=None,
        metavar="FILE",
        help="append every engine step's shape and time to FILE (JSON lines), for `carpool cost whatif --steps` "
        "to fit its step model on the steps this traffic took (one process; not with --replicas)",
    )
    parser.add_argument(
        "--capacity-plan",
        default=None,
        metavar="FILE",
        help="with --replicas MIN:MAX: `carpool capacity plan --format json` output; the autoscaler keeps at least "
        "its replicas, each started ahead by the plan's replica start time (re-plan on a timer: the file is read "
        "again when it changes)",
    )
    parser.add_argument(
        "--routing",
        default="prefix",
        choices=["prefix", "least-loaded", "round-robin"],
        help="how --replicas picks a replica: the one most likely to hold the prompt's prefix in "
        "its cache (default), the least loaded, or in turn",
    )
    parser.add_argument(
        "--ray-address",
        default=None,
        help="the Ray cluster the replicas run on (default: a local one started for this server)",
    )
    add_gate_args(parser)
    add_engine_args(parser)
    parser.add_argument(
        "--model",
        action="append",
        default=None,
        help="a model to serve: GGUF file, safetensors directory or short name (repeatable: one "
        "engine and KV pool per model; default: SmolLM2-135M-Instruct)",
    )
    parser.add_argument(
        "--served-model-name",
        action="append",
        default=None,
        help="the name clients pass as `model`, one per --model in order (default: the model's own name)",
    )
    parser.add_argument(
        "--kv-cache-gb",
        type=float,
        action="append",
        default=None,
        help=f"KV pool per model, one value for all or one per --model (default: {defaults.kv_cache_gb})",
    )
    parser.add_argument(
        "--num-kv-blocks",
        type=int,
        action="append",
        default=None,
        help="exact KV pool per model in blocks, overrides --kv-cache-gb (one for all or one per --model)",
    )
    parser.add_argument(
        "--max-num-seqs",
        type=int,
        action="append",
        default=None,
        help=f"sequence slots per model, one for all or one per --model (default: {defaults.max_num_seqs})",
    )
    parser.add_argument(
        "--slo-itl-ms",
        action="append",
        default=None,
        metavar="TIER=MS",
        help="inter-token latency SLO of a tier (repeatable): each step's token budget and batch "
        "size then follow measured step times so the highest tier present meets it, and grow "
        "to --max-num-batched-tokens / --max-num-seqs when none is present",
    )
    parser.add_argument(
        "--slo-ttft-ms",
        action="append",
        default=None,
        metavar="TIER=MS",
        help="time-to-first-token SLO of a tier (repeatable): the SLO controller keeps the step "
        "large enough to prefill that tier's prompts in time",
    )
    parser.set_defaults(func=lambda args: serve(args, model_configs(args)))


def log_steps(engines: dict, path: str):
    """--step-log: each in-process engine's steps appended to `path` (carpool.server.step_log)."""
    from carpool.server.step_log import StepLog

    step_log = StepLog(path)
    for name, engine in engines.items():
        engine.add_step_listener(step_log.listener(name))
    return step_log


def serve(args: argparse.Namespace, configs: dict) -> int:
    # Checked before any model loads: a bad file or a step naming an unserved model fails at once.
    checked_extensions(args, configs)
    if args.hourly_price is not None and args.hourly_price <= 0:
        raise ValueError(f"--hourly-price must be positive, got {args.hourly_price}")
    scale_down_delay(args)  # checked before anything starts: each raises a ValueError naming its flag
    capacity_plan(args)
    if args.step_log and args.replicas:
        raise ValueError("--step-log: not with --replicas (each replica's engine steps in a process of its own)")
    if args.replicas:
        from carpool.server.replicas.serve import serve_replicas

        return serve_replicas(args, configs)
    import uvicorn

    from carpool.engine.async_engine import AsyncEngine, EngineLoop

    stores = open_stores(args, configs)
    # One loop steps every model's engine, on this (the main) thread: see AsyncEngine for why. The models load
    # before the port opens, so /health answers only when all are ready.
    engine_loop = EngineLoop()
    engines = {
        name: AsyncEngine(config, engine_loop=engine_loop, warmup=not args.no_warmup)
        for name, config in configs.items()
    }
    app = build_app(args, configs, engines, stores, meter_phases(engines))
    step_log = log_steps(engines, args.step_log) if args.step_log else None
    if args.hourly_price is not None:
        check_prices_after_warmup(engines, args.prices, args.hourly_price)
    # The engine loop and HTTP share the GIL; at Python's default 5 ms switch interval a thread that wants it can
    # wait a third of a decode step. 1 ms: +15-20% output tokens/s at 8 and 32 streams here (carpool bench
    # serve, 2 cores).
    sys.setswitchinterval(0.001)
    server = uvicorn.Server(
        uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level, timeout_graceful_shutdown=5)
    )
    engine_loop.drive_from_caller()

    def serve_http():
        try:
            server.run()
        finally:  # however HTTP ends (shutdown, a port already in use), the engine loop ends with it
            engine_loop.stop()

    http = threading.Thread(target=serve_http, name="carpool-http")

    def shut_down(signum, frame):  # graceful: in-flight requests finish, then the app stops the engine loop
        server.should_exit = True

    signal.signal(signal.SIGINT, shut_down)
    signal.signal(signal.SIGTERM, shut_down)
    http.start()
    try:
        engine_loop.run()
    finally:
        server.should_exit = True
        http.join()
        stores.close()
        if step_log:
            step_log.close()
    return 0 if server.started else 1
