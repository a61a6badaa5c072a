"""The server's assembly, one place for every way of serving (`carpool serve`, `carpool serve --replicas` and the
Ray Serve deployment): the served models' engine configs from the flags, the gate and its ledger, the batch
dir, and the app over whatever engines run the models (in-process AsyncEngines or ReplicaRouters).

The one server module besides the command line's flags that knows concrete economics (the ledger gate, its
routes, metrics and dashboard panels): everything else in carpool.server sees only carpool.economics.contract.
"""

import argparse
from dataclasses import dataclass

from carpool.engine.args import engine_config

# Flags that take a value per --model (dest, the EngineConfig field or None, whether one value may serve all).
PER_MODEL_FLAGS = (
    ("served_model_name", None, False),
    ("kv_cache_gb", "kv_cache_gb", True),
    ("num_kv_blocks", "num_kv_blocks", True),
    ("max_num_seqs", "max_num_seqs", True),
)


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


@dataclass
class Stores:
    """What a server keeps outside its engines, opened before any model loads: the ledger gate (None with fixed
    --api-key's), the batch dir and the lock that makes it this server's while it runs."""

    ledger: object | None
    batch_dir: str
    batch_dir_lock: object

    def close(self) -> None:
        if self.ledger:
            self.ledger.close()
        self.batch_dir_lock.close()


def open_stores(args: argparse.Namespace, configs: dict) -> Stores:
    """The ledger gate (or none), the batch dir and its lock, for every way of serving (one process, or replicas).

    A fixed key list means no ledger; otherwise the key store, budgets and ledger in --db. Opened before the
    models load, so a bad price sheet, or one that prices no served model, fails at once. So is the batch dir
    (created, writable, and this database's), so no store fails after minutes of loading. The sheet's minimum
    cacheable prefix ([cache] min_tokens) goes into every engine's config, for their doors' cache breakpoints
    (without a ledger there is no sheet: EngineConfig's default, the shipped sheet's 1024)."""
    from carpool.economics.db import default_db_path
    from carpool.economics.ledger_gate import open_ledger_gate
    from carpool.server.batch.home import claim_batch_dir, default_batch_dir

    ledger = None if args.api_key else open_ledger_gate(args.db, args.prices, served_models=tuple(configs))
    for config in configs.values() if ledger else ():  # the sheet's shortest cacheable prefix, for every door
        config.cache_min_tokens = ledger.prices.cache_min_tokens
    db_path = args.db or default_db_path()
    batch_dir = args.batch_dir or default_batch_dir(db_path, ledger=ledger is not None)
    batch_dir_lock = claim_batch_dir(batch_dir, db_path if ledger else None)  # held while this server runs
    return Stores(ledger, batch_dir, batch_dir_lock)


def shared_batch_db(args: argparse.Namespace, ledger) -> str | None:
    """The PostgreSQL --db whose replicas share the Batch API's metadata (a ledger's server only); None: the
    metadata stays in the batch dir (SQLite)."""
    from carpool.economics.db import default_db_path
    from carpool.postgres import is_postgres_url

    db = args.db or default_db_path()
    return db if ledger and is_postgres_url(db) else None


def dashboard_ledger_panels(ledger, args: argparse.Namespace, phases: dict | None):
    """The ledger's part of /dashboard (spend and budgets per key; with --hourly-price and the engines' phase
    meters, margin per tier and tenant), or None on a server without a ledger."""
    import time

    from carpool.economics.dashboard import ledger_panels
    from carpool.economics.margin import MachineBill
    from carpool.economics.prices import load_price_sheet

    if not ledger:
        return None
    priced = phases and getattr(args, "hourly_price", None)
    bill = MachineBill(args.hourly_price, time.time(), phases, load_price_sheet(args.prices)) if priced else None
    return ledger_panels(ledger, bill)


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


def build_app(args: argparse.Namespace, configs: dict, engines: dict, stores: Stores, phases: dict | None = None):
    """The carpool app over `engines` ({served name: AsyncEngine or ReplicaRouter}), with the gate, the Batch API,
    the extensions of the flags and the ledger's routes and series. `configs`: model_configs(args); `phases`:
    in-process engines' phase meters (meter_phases), for the margin panel."""
    from carpool.server.app import create_app
    from carpool.server.open_gate import OpenGate

    app = create_app(
        engines,
        stores.ledger or OpenGate(args.api_key),
        max_queued_per_tier=args.max_queued_per_tier,
        max_body_bytes=args.max_body_bytes,
        batch_dir=str(stores.batch_dir),
        batch_db=shared_batch_db(args, stores.ledger),
        ledger_panels=dashboard_ledger_panels(stores.ledger, args, phases),
        cascades=checked_extensions(args, configs),
        compression_model=args.compression_model,
    )
    attach_ledger(app, stores.ledger, args)
    if phases:
        from carpool.economics.phase_meter import register_phase_metrics

        register_phase_metrics(app.state.metrics.registry, phases)
    return app


def meter_phases(engines: dict) -> dict:
    """The prefill/decode split of engine time per model (`carpool:phase_*` once build_app registers them), from
    in-process engines' steps."""
    from carpool.economics.phase_meter import PhaseMeter

    phases = {name: PhaseMeter() for name in engines}
    for name, engine in engines.items():
        engine.add_step_listener(phases[name])
    return phases


def check_prices_after_warmup(engines: dict, prices_path: str | None, hourly_price: float) -> None:
    """`--hourly-price`: once each engine's warm-up has measured its decode rate, a warning (logged: the operator
    may price below cost on purpose) for every tier whose list output price does not cover the machine. On a
    thread of its own, so the port opens while the engines warm up."""
    import logging
    import threading

    from carpool.economics.prices import load_price_sheet
    from carpool.economics.suggested_prices import below_cost

    prices, log = load_price_sheet(prices_path), logging.getLogger("carpool.server")

    def check() -> None:
        for name, engine in engines.items():
            engine.ready.wait()
            report = engine.warmup_report
            if report is None or report.decode_tokens_per_second is None:
                log.warning("%s: no warm-up ran, so --hourly-price has no decode rate to check the prices by", name)
                continue
            for line in below_cost(name, prices, hourly_price, report.decode_tokens_per_second):
                log.warning(line)

    threading.Thread(target=check, name="carpool-price-check", daemon=True).start()
