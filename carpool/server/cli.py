"""`carpool serve`: the OpenAI-compatible server on 127.0.0.1:8000 by default."""

import argparse
import signal
import sys
import threading

from carpool.economics.cli import add_gate_args
from carpool.server import limits


def add_serve_parser(subparsers, add_engine_args, engine_config) -> None:
    parser = subparsers.add_parser("serve", help="serve the OpenAI-compatible API over HTTP")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--api-key", action="append", default=[],
                        help="accept only these keys, with no ledger (repeatable; default: the key store in --db, "
                             "open to everyone while it holds no keys)")
    parser.add_argument("--served-model-name", default=None,
                        help="the name clients pass as `model` (default: the model file's name)")
    parser.add_argument("--max-queued-per-tier", type=int, default=limits.MAX_QUEUED_PER_TIER,
                        help="requests waiting for their first token, per service tier, before 429s")
    parser.add_argument("--max-body-bytes", type=int, default=limits.MAX_BODY_BYTES)
    parser.add_argument("--batch-dir", default=None,
                        help="where batches and files live (default: $CARPOOL_BATCH_DIR or ~/.cache/carpool/batches)")
    parser.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    add_gate_args(parser)
    add_engine_args(parser)
    parser.set_defaults(func=lambda args: serve(args, engine_config(args)))


def serve(args: argparse.Namespace, config) -> int:
    import uvicorn

    from carpool.economics.gate import open_ledger_gate
    from carpool.economics.phase_meter import PhaseMeter
    from carpool.economics.routes import usage_router
    from carpool.engine.async_engine import AsyncEngine
    from carpool.models.loader import default_model_path, model_name
    from carpool.server.app import create_app
    from carpool.server.batch.limits import default_batch_dir
    from carpool.server.gate import OpenGate

    served_name = args.served_model_name or model_name(config.model or default_model_path())
    # A fixed key list means no ledger; otherwise the key store, budgets and ledger in --db. Opened before the
    # model loads, so a bad price sheet fails at once.
    ledger = None if args.api_key else open_ledger_gate(args.db, args.prices, served_models=(served_name,))
    engine = AsyncEngine(config)  # loads the model before the port opens, so /health answers only when ready
    app = create_app(
        engine,
        ledger or OpenGate(args.api_key),
        model_name=served_name,
        max_queued_per_tier=args.max_queued_per_tier,
        max_body_bytes=args.max_body_bytes,
        batch_dir=str(args.batch_dir or default_batch_dir()),
    )
    registry = app.state.metrics.registry
    phases = PhaseMeter()
    engine.add_step_listener(phases)
    phases.register_metrics(registry)
    if ledger:
        ledger.register_metrics(registry)
        app.include_router(usage_router(ledger))
    # The engine loop runs on this (the main) thread and HTTP on another: see AsyncEngine for why. The two share
    # the GIL; at Python's default 5 ms switch interval a thread that wants it can wait a third of a decode
    # step. 1 ms: +15-20% output tokens/s at 8 and 32 streams here (carpool bench serve, 2 cores).
    sys.setswitchinterval(0.001)
    server = uvicorn.Server(uvicorn.Config(
        app, host=args.host, port=args.port, log_level=args.log_level, timeout_graceful_shutdown=5
    ))
    engine.drive_from_caller()

    def serve_http():
        try:
            server.run()
        finally:  # however HTTP ends (shutdown, a port already in use), the engine loop ends with it
            engine.stop()

    http = threading.Thread(target=serve_http, name="carpool-http")

    def shut_down(signum, frame):  # graceful: in-flight requests finish, then the app stops the engine
        server.should_exit = True

    signal.signal(signal.SIGINT, shut_down)
    signal.signal(signal.SIGTERM, shut_down)
    http.start()
    try:
        engine.run()
    finally:
        server.should_exit = True
        http.join()
        if ledger:
            ledger.close()
    return 0 if server.started else 1
