"""`carpool serve`: the OpenAI-compatible server on 127.0.0.1:8000 by default, for one model or several.

`--model A --model B` serves both, each with an engine and KV pool of its own; the per-model flags below are
matched to the models by position, and one value applies to every model.
"""

import argparse
import signal
import sys
import threading

from carpool.economics.cli import add_gate_args
from carpool.engine.args import add_engine_args, engine_config
from carpool.engine.config import EngineConfig
from carpool.server import limits

# Flags that take a value per --model (dest, the EngineConfig field or None, whether one value may serve all).
PER_MODEL_FLAGS = (
    ("served_model_name", None, False),
    ("kv_cache_gb", "kv_cache_gb", True),
    ("num_kv_blocks", "num_kv_blocks", True),
    ("max_num_seqs", "max_num_seqs", True),
)


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
        "order, escalating when a step's answer scores below its threshold "
        "(carpool.server.cascade.config; `carpool cascade calibrate` fits the thresholds)",
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
        type=int,
        default=0,
        help="serve each model from N engine replicas on Ray Serve behind this one endpoint (needs "
        "`make scale`; --num-threads is then each replica's; default: one engine in-process)",
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


def default_served_name(model: str | None) -> str:
    """What clients call a model served without --served-model-name: a catalog model's short name, else the
    file or directory name."""
    from carpool.models.catalog import served_name

    return served_name(model)


def model_configs(args: argparse.Namespace) -> dict:
    """{served name: EngineConfig} for each --model in order, with its per-model flags applied; ValueError
    naming the flag when the counts do not match the models or two models would share a name."""
    models = args.model or [None]
    per_model = {dest: _values_per_model(args, dest, broadcast, len(models)) for dest, _, broadcast in PER_MODEL_FLAGS}
    shared = {key: value for key, value in vars(args).items() if key not in per_model and key != "model"}
    shared |= {dest: slo_flag(args, dest) for dest in ("slo_itl_ms", "slo_ttft_ms")}
    configs = {}
    for index, model in enumerate(models):
        name = per_model["served_model_name"][index] or default_served_name(model)
        if name in configs:
            raise ValueError(
                f"--served-model-name: two models would be served as {name!r}; give each --model a "
                "--served-model-name of its own"
            )
        overrides = {field: per_model[dest][index] for dest, field, _ in PER_MODEL_FLAGS if field is not None}
        overrides = {field: value for field, value in overrides.items() if value is not None}
        configs[name] = engine_config(argparse.Namespace(**shared, model=model, **overrides))
    return configs


def slo_flag(args: argparse.Namespace, dest: str) -> dict[str, float]:
    """--slo-*-ms TIER=MS values as {tier: ms}; ValueError naming the flag."""
    from carpool.engine.slo import parse_slo

    flag, slos = "--" + dest.replace("_", "-"), {}
    for text in getattr(args, dest, None) or ():
        try:
            tier, ms = parse_slo(text)
        except ValueError as error:
            raise ValueError(f"{flag}: {error}") from None
        if tier in slos:
            raise ValueError(f"{flag}: tier {tier!r} given twice")
        slos[tier] = ms
    return slos


def _values_per_model(args: argparse.Namespace, dest: str, broadcast: bool, num_models: int) -> list:
    values = getattr(args, dest)
    if not values:
        return [None] * num_models
    if broadcast and len(values) == 1:
        return values * num_models
    if len(values) != num_models:
        flag = "--" + dest.replace("_", "-")
        allowed = "one per --model" if not broadcast else "one for every model or one per --model"
        raise ValueError(f"{flag}: {len(values)} values for {num_models} models; give {allowed}")
    return values


def open_gate(args: argparse.Namespace, configs: dict) -> tuple:
    """(ledger gate or None, batch dir, its lock), for every way of serving (one process, or replicas).

    A fixed key list means no ledger; otherwise the key store, budgets and ledger in --db. Opened before the
    models load, so a bad price sheet, or one that prices no served model, fails at once. So is the batch dir
    (created, writable, and this database's), so no store fails after minutes of loading."""
    from carpool.economics.db import default_db_path
    from carpool.economics.gate import open_ledger_gate
    from carpool.server.batch.home import claim_batch_dir, default_batch_dir

    ledger = None if args.api_key else open_ledger_gate(args.db, args.prices, served_models=tuple(configs))
    db_path = args.db or default_db_path()
    batch_dir = args.batch_dir or default_batch_dir(db_path, ledger=ledger is not None)
    batch_dir_lock = claim_batch_dir(batch_dir, db_path if ledger else None)  # held while this server runs
    return ledger, batch_dir, batch_dir_lock


def shared_batch_db(args: argparse.Namespace, ledger) -> str | None:
    """The PostgreSQL --db whose replicas share the Batch API's metadata (a ledger's server only); None: the
    metadata stays in the batch dir (SQLite)."""
    from carpool.economics.db import default_db_path
    from carpool.postgres import is_postgres_url

    db = args.db or default_db_path()
    return db if ledger and is_postgres_url(db) else None


def dashboard_ledger_panels(ledger):
    """The ledger's part of /dashboard (spend and budgets per key), or None on a server without a ledger."""
    from carpool.economics.dashboard import ledger_panels

    return ledger_panels(ledger) if ledger else None


def attach_ledger(app, ledger, args: argparse.Namespace) -> None:
    """The ledger's /metrics series and usage routes, when there is a ledger."""
    from carpool.economics.routes import usage_router
    from carpool.server.auth import request_principal
    from carpool.server.errors import documented

    if ledger:
        ledger.register_metrics(app.state.metrics.registry, per_tenant=args.metrics_tenants)
        app.include_router(usage_router(ledger, caller=request_principal), responses=documented(403))


def checked_extensions(args: argparse.Namespace, configs: dict) -> dict | None:
    """The cascades of --cascades, with --cascades and --compression-model checked against the served models (in
    every mode: one process, `carpool serve --replicas` and the Ray Serve deployment); ValueError naming the flag."""
    from carpool.server.cascade.config import load_cascades

    cascades = load_cascades(args.cascades, list(configs)) if args.cascades else None
    if args.compression_model is not None and args.compression_model not in configs:
        raise ValueError(
            f"--compression-model: {args.compression_model!r} is not served (served: {', '.join(configs)})"
        )
    return cascades


def serve(args: argparse.Namespace, configs: dict) -> int:
    # Checked before any model loads: a bad file or a step naming an unserved model fails at once.
    cascades = checked_extensions(args, configs)
    if args.replicas:
        from carpool.server.replicas.serve import serve_replicas

        return serve_replicas(args, configs, cascades)
    import uvicorn

    from carpool.economics.phase_meter import PhaseMeter, register_phase_metrics
    from carpool.engine.async_engine import AsyncEngine, EngineLoop
    from carpool.server.app import create_app
    from carpool.server.gate import OpenGate

    ledger, batch_dir, batch_dir_lock = open_gate(args, configs)
    # One loop steps every model's engine, on this (the main) thread: see AsyncEngine for why. The models load
    # before the port opens, so /health answers only when all are ready.
    engine_loop = EngineLoop()
    engines = {
        name: AsyncEngine(config, engine_loop=engine_loop, warmup=not args.no_warmup)
        for name, config in configs.items()
    }
    app = create_app(
        engines,
        ledger or OpenGate(args.api_key),
        max_queued_per_tier=args.max_queued_per_tier,
        max_body_bytes=args.max_body_bytes,
        batch_dir=str(batch_dir),
        batch_db=shared_batch_db(args, ledger),
        ledger_panels=dashboard_ledger_panels(ledger),
        cascades=cascades,
        compression_model=args.compression_model,
    )
    registry = app.state.metrics.registry
    phases = {name: PhaseMeter() for name in engines}
    for name, engine in engines.items():
        engine.add_step_listener(phases[name])
    register_phase_metrics(registry, phases)
    attach_ledger(app, ledger, args)
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
        if ledger:
            ledger.close()
        batch_dir_lock.close()
    return 0 if server.started else 1
