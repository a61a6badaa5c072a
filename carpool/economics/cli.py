"""`carpool keys ...` and `carpool cost ...`: key management, usage reports and the self-hosting cost model."""

import argparse
import json
import sys
import urllib.request
from contextlib import closing
from datetime import UTC, datetime
from pathlib import Path

import torch

from carpool.economics import capacity
from carpool.economics import keys as key_store
from carpool.economics.contract import SCOPES
from carpool.economics.cost_model import CostModel, cost_model
from carpool.economics.cost_model import render as render_cost_model
from carpool.economics.db import default_db_path, open_database
from carpool.economics.footprint import model_footprint
from carpool.economics.hardware import measure_hardware
from carpool.economics.phase_meter import PhaseTotals, totals_from_metrics_text
from carpool.economics.prices import PriceSheet, load_price_sheet
from carpool.economics.reports import (
    FORMATS,
    GROUP_BY,
    cascade_summary,
    parse_time,
    render,
    render_cascades,
    usage_summary,
)
from carpool.economics.suggested_prices import render as render_suggested
from carpool.economics.suggested_prices import sheet_toml, suggest
from carpool.engine.config import DTYPES, resolve_dtype
from carpool.engine.tiers import TIER_NAMES
from carpool.models.quantization import QUANTIZATION_MODES


def add_gate_args(parser: argparse.ArgumentParser) -> None:
    """`--db`, `--prices` and `--metrics-tenants` for `carpool serve`: pass the first two to
    `open_ledger_gate(args.db, args.prices, ...)`, the last to `register_metrics`."""
    _add_db_arg(parser)
    parser.add_argument("--prices", default=None, help="price sheet TOML (default: the shipped one)")
    parser.add_argument(
        "--metrics-tenants",
        action="store_true",
        help="label carpool:cost on /metrics by tenant too (/metrics needs no key, so tenant names "
        "and their spend are shown only with this flag)",
    )


def add_keys_parser(subparsers) -> None:
    parser = subparsers.add_parser("keys", help="API keys: create, list, revoke, set budgets")
    commands = parser.add_subparsers(dest="keys_command", required=True)

    create = commands.add_parser("create", help="create a key and print its secret (shown only this once)")
    create.add_argument("--tenant", required=True, help="who pays for this key's requests")
    create.add_argument(
        "--scope",
        action="append",
        choices=SCOPES,
        default=[],
        help="what the key may do beyond its own tenant's work (repeat for several): usage:read (usage reports, "
        "dashboard), batches:read-all (every tenant's batches), files:read-all (every tenant's files, i.e. their "
        "prompts; each read is audited)",
    )
    create.add_argument(
        "--admin", action="store_true", help=f"shorthand for --scope {' --scope '.join(sorted(key_store.ADMIN_SCOPES))}"
    )
    create.add_argument(
        "--tiers",
        type=_tier_list,
        default=None,
        help=f"comma-separated subset of {','.join(TIER_NAMES)} (default: all)",
    )
    _add_budget_args(create)
    create.add_argument("--rpm", type=int, default=None, help="requests per minute (default: unlimited)")
    create.add_argument("--tpm", type=int, default=None, help="tokens per minute (default: unlimited)")
    create.set_defaults(func=_keys_create)

    listing = commands.add_parser("list", help="list keys (never their secrets)")
    listing.add_argument("--format", choices=("table", "json"), default="table", help="output format (default: table)")
    listing.set_defaults(func=_keys_list)

    revoke = commands.add_parser("revoke", help="revoke a key; a running server refuses it from its next request")
    revoke.add_argument("key_id", help="the key's id, as `keys list` shows it")
    revoke.set_defaults(func=_keys_revoke)

    budget = commands.add_parser("set-budget", help="set or clear a key's budget")
    budget.add_argument("key_id", help="the key's id, as `keys list` shows it")
    group = budget.add_mutually_exclusive_group(required=True)
    group.add_argument("--budget", type=float, help="dollars per period")
    group.add_argument("--clear", action="store_true", help="remove the budget")
    budget.add_argument("--budget-period", choices=key_store.BUDGET_PERIODS, default=None, help="default: month")
    budget.set_defaults(func=_keys_set_budget)

    for command in (create, listing, revoke, budget):
        _add_db_arg(command)


def add_cost_parser(subparsers):
    """`carpool cost ...`; returns its subcommands, for `whatif` (which replays through the bench's simulator, a
    room economics does not import) to join them."""
    parser = subparsers.add_parser("cost", help="usage reports and the self-hosting cost model")
    commands = parser.add_subparsers(dest="cost_command", required=True)

    report = commands.add_parser("report", help="tokens, cost and time share from the ledger")
    report.add_argument("--group-by", choices=tuple(GROUP_BY), default="tenant", help="one row per (default: tenant)")
    report.add_argument("--start", type=_time_arg, default=None, help="unix seconds or ISO 8601 (UTC), inclusive")
    report.add_argument("--end", type=_time_arg, default=None, help="unix seconds or ISO 8601 (UTC), exclusive")
    report.add_argument("--format", choices=FORMATS, default="table", help="output format (default: table)")
    _add_db_arg(report)
    report.set_defaults(func=_cost_report)

    cascades = commands.add_parser(
        "cascades",
        help="per model cascade: share answered by each step, cost, and "
        "cost saved versus the last model alone (estimated)",
    )
    cascades.add_argument("--start", type=_time_arg, default=None, help="unix seconds or ISO 8601 (UTC), inclusive")
    cascades.add_argument("--end", type=_time_arg, default=None, help="unix seconds or ISO 8601 (UTC), exclusive")
    cascades.add_argument("--format", choices=("table", "json"), default="table", help="output format")
    cascades.add_argument("--prices", default=None, help="price sheet for the estimate (default: the shipped one)")
    _add_db_arg(cascades)
    cascades.set_defaults(func=_cost_cascades)

    model = commands.add_parser("model", help="cost per 1M tokens per tier from measured throughput, and decode floors")
    _add_measurement_args(model)
    model.add_argument("--format", choices=("table", "json"), default="table", help="output format (default: table)")
    model.set_defaults(func=_cost_model)

    prices = commands.add_parser(
        "prices",
        help="a price sheet that covers the machine at a target utilization and margin, from measured throughput",
    )
    _add_measurement_args(prices)
    prices.add_argument(
        "--target-utilization",
        type=float,
        required=True,
        help="the share of the hour the machine is busy (0-1]: each token carries the idle time's cost too",
    )
    prices.add_argument("--margin", type=float, default=0.0, help="over the machine's cost, e.g. 0.3 (default: 0)")
    prices.add_argument("--out", type=Path, default=None, help="write the sheet here (default: stdout)")
    prices.set_defaults(func=_cost_prices)
    return commands


def add_capacity_parser(subparsers) -> None:
    parser = subparsers.add_parser("capacity", help="forecast traffic from the ledger and plan replicas for it")
    commands = parser.add_subparsers(dest="capacity_command", required=True)
    planning = commands.add_parser(
        "plan",
        help="the next hour's traffic per minute (the ledger's last days at the same time of day) and the replicas "
        "it needs, each started ahead by a replica's start time",
    )
    _add_phase_source(planning)
    planning.add_argument("--at", type=_time_arg, default=None, help="when the plan starts (default: now)")
    planning.add_argument(
        "--days", type=int, default=capacity.PROFILE_DAYS, help="days of the ledger the profile averages (default: 7)"
    )
    planning.add_argument("--horizon-minutes", type=int, default=60, help="minutes planned (default: 60)")
    planning.add_argument("--smooth-minutes", type=int, default=5, help="minutes averaged either side (default: 5)")
    planning.add_argument(
        "--target-utilization", type=float, default=0.7, help="busy share a replica is planned for (default: 0.7)"
    )
    planning.add_argument("--min-replicas", type=int, default=1, help="never fewer (default: 1)")
    planning.add_argument("--max-replicas", type=int, default=64, help="never more (default: 64)")
    planning.add_argument(
        "--replica-start-seconds",
        type=float,
        default=60.0,
        help="how long a replica takes to load and warm up before it takes traffic (python -m "
        "carpool.bench.warm_start measures it; default: 60)",
    )
    planning.add_argument("--format", choices=("table", "json"), default="table", help="output format")
    _add_db_arg(planning)
    planning.set_defaults(func=_capacity_plan)


def _capacity_plan(args: argparse.Namespace) -> int:
    with _open(args) as conn:
        planned = capacity.plan(
            conn,
            _phase_totals(args),
            model=args.served_model_name,
            at=args.at,
            days=args.days,
            horizon_minutes=args.horizon_minutes,
            smooth_minutes=args.smooth_minutes,
            target_utilization=args.target_utilization,
            min_replicas=args.min_replicas,
            max_replicas=args.max_replicas,
        )
    if args.format == "json":
        steps = capacity.actions(planned, args.replica_start_seconds)
        document = {
            "minutes": [{**vars(m), "live": vars(m.live), "batch": vars(m.batch)} for m in planned],
            "actions": [{"at": when, "action": what} for when, what in steps],
            "replica_start_seconds": args.replica_start_seconds,  # `carpool serve --capacity-plan` starts ahead by it
        }
        print(json.dumps(document, indent=2))
    else:
        print(capacity.render(planned, args.replica_start_seconds))
    return 0


def _add_phase_source(parser: argparse.ArgumentParser) -> None:
    """Where the engine's measured phase totals (seconds per prompt and output token) come from."""
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--metrics", help="a running server's /metrics URL, or a saved copy of it")
    source.add_argument(
        "--bench", type=Path, help='a benchmark run\'s JSON file whose "phases" object holds PhaseMeter totals'
    )
    parser.add_argument(
        "--served-model-name",
        default=None,
        help="with --metrics from a server of several models: the one whose totals to read",
    )


def _add_measurement_args(model: argparse.ArgumentParser) -> None:
    """What the cost model reads: the machine's price, the engine's measured phase totals, the model as served."""
    model.add_argument("--hourly-price", type=float, required=True, help="dollars per hour for the machine")
    _add_phase_source(model)
    model.add_argument("--model", default=None, help="the model served (default: SmolLM2-135M-Instruct)")
    model.add_argument("--prices", default=None, help="price sheet for the list-price columns (default: shipped)")
    model.add_argument("--device", default=None, help="where to measure bandwidth and FLOP/s (default: cuda if any)")
    model.add_argument("--dtype", default="auto", choices=["auto", *DTYPES], help="as served (default: auto)")
    model.add_argument(
        "--quantization",
        default="auto",
        choices=list(QUANTIZATION_MODES),
        help="weight format as served (default: auto)",
    )


# keys ---------------------------------------------------------------------------------------------------


def _keys_create(args: argparse.Namespace) -> int:
    with _open(args) as conn:
        key, secret = key_store.create_key(
            conn,
            args.tenant,
            scopes=set(args.scope) | (key_store.ADMIN_SCOPES if args.admin else set()),
            allowed_tiers=args.tiers,
            budget=args.budget,
            budget_period=_period(args.budget, args.budget_period),
            rpm=args.rpm,
            tpm=args.tpm,
        )
    # The secret alone on stdout, so `KEY=$(carpool keys create ...)` works; the rest goes to stderr.
    print(secret)
    print(f"created {key.key_id} for tenant {key.tenant}; the secret above is shown only once", file=sys.stderr)
    return 0


def _keys_list(args: argparse.Namespace) -> int:
    with _open(args) as conn:
        keys = key_store.list_keys(conn)
    if args.format == "json":
        print(json.dumps([_key_fields(key) for key in keys], indent=2))
        return 0
    rows = [["key_id", "tenant", "scopes", "tiers", "budget", "rpm", "tpm", "created", "status"]]
    for key in keys:
        fields = _key_fields(key)
        rows.append(
            [
                key.key_id,
                key.tenant,
                ",".join(fields["scopes"]),
                fields["tiers"] or "all",
                f"${key.budget:g}/{key.budget_period}" if key.budget is not None else "",
                str(key.rpm or ""),
                str(key.tpm or ""),
                fields["created"],
                "revoked" if key.revoked is not None else "active",
            ]
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip())
    return 0


def _keys_revoke(args: argparse.Namespace) -> int:
    with _open(args) as conn:
        key = key_store.revoke_key(conn, args.key_id)
    print(f"revoked {key.key_id} (tenant {key.tenant})")
    return 0


def _keys_set_budget(args: argparse.Namespace) -> int:
    budget = None if args.clear else args.budget
    with _open(args) as conn:
        key = key_store.set_budget(conn, args.key_id, budget, _period(budget, args.budget_period))
    print(
        f"{key.key_id}: "
        + (f"budget ${key.budget:g} per {key.budget_period}" if key.budget is not None else "no budget")
    )
    return 0


# cost ---------------------------------------------------------------------------------------------------


def _cost_report(args: argparse.Namespace) -> int:
    with _open(args) as conn:
        rows = usage_summary(conn, args.group_by, args.start, args.end)
    sys.stdout.write(render(rows, args.group_by, args.format, args.start, args.end))
    return 0


def _cost_model(args: argparse.Namespace) -> int:
    sys.stdout.write(render_cost_model(_measured_cost_model(args, load_price_sheet(args.prices)), args.format))
    return 0


def _cost_prices(args: argparse.Namespace) -> int:
    prices = load_price_sheet(args.prices)
    suggested = suggest(_measured_cost_model(args, prices), prices, args.target_utilization, args.margin)
    sheet = sheet_toml(suggested, prices, datetime.now(UTC).strftime("%Y-%m-%d"))
    if args.out is None:
        sys.stdout.write(sheet)
    else:
        args.out.write_text(sheet)
    # The comparison on stderr, so that `> prices.toml` keeps the sheet alone.
    sys.stderr.write(render_suggested(suggested, prices.price(suggested.model.model)))
    return 0


def _measured_cost_model(args: argparse.Namespace, prices: PriceSheet) -> CostModel:
    """The cost model of the measurements the arguments name (the sheet loaded first: a bad one fails before the
    measurements run)."""
    phases = _phase_totals(args)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    footprint = model_footprint(args.model, resolve_dtype(args.dtype, device), args.quantization)
    return cost_model(phases, args.hourly_price, measure_hardware(args.device), footprint, prices)


def _phase_totals(args: argparse.Namespace) -> PhaseTotals:
    """The engine phase totals of --bench (a run's JSON) or --metrics (a server's, or a saved copy)."""
    if args.bench is not None:
        document = json.loads(args.bench.read_text())
        if "phases" not in document:
            raise ValueError(f'{args.bench}: no "phases" object (the engine phase totals of the run)')
        return PhaseTotals.from_dict(document["phases"])
    return totals_from_metrics_text(_read_metrics(args.metrics), args.served_model_name)


def _read_metrics(source: str) -> str:
    if source.startswith(("http://", "https://")):
        with urllib.request.urlopen(source, timeout=10) as response:
            return response.read().decode()
    return Path(source).read_text()


def _cost_cascades(args: argparse.Namespace) -> int:
    prices = load_price_sheet(args.prices)
    with _open(args) as conn:
        rows = cascade_summary(conn, prices, args.start, args.end)
    sys.stdout.write(render_cascades(rows, args.format))
    return 0


# shared -------------------------------------------------------------------------------------------------


def _add_db_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--db",
        default=None,
        help="SQLite file, or a postgresql://user@host/dbname URL that several replicas share "
        "(default: $CARPOOL_DB or ~/.cache/carpool/carpool.db)",
    )


def _add_budget_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--budget", type=float, default=None, help="dollars per budget period (default: no budget)")
    parser.add_argument("--budget-period", choices=key_store.BUDGET_PERIODS, default=None, help="default: month")


def _open(args: argparse.Namespace):
    """A connection that closes itself (sqlite3's own context manager only commits)."""
    return closing(open_database(args.db or default_db_path()))


def _period(budget: float | None, period: str | None) -> str | None:
    """A budget's period defaults to a month; a period without a budget is passed on to be refused."""
    return (period or "month") if budget is not None else period


def _time_arg(text: str) -> float:
    try:
        return parse_time(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _tier_list(text: str) -> list[str]:
    tiers = [t.strip() for t in text.split(",") if t.strip()]
    unknown = [t for t in tiers if t not in TIER_NAMES]
    if unknown or not tiers:
        raise argparse.ArgumentTypeError(f"tiers must be a comma-separated subset of {','.join(TIER_NAMES)}")
    return tiers


def _key_fields(key: key_store.ApiKey) -> dict:
    return {
        "key_id": key.key_id,
        "tenant": key.tenant,
        "scopes": [scope for scope in SCOPES if scope in key.scopes],
        "tiers": ",".join(t for t in TIER_NAMES if t in key.allowed_tiers) if key.allowed_tiers is not None else None,
        "budget": key.budget,
        "budget_period": key.budget_period,
        "rpm": key.rpm,
        "tpm": key.tpm,
        "created": datetime.fromtimestamp(key.created, UTC).isoformat(timespec="seconds"),
        "revoked": datetime.fromtimestamp(key.revoked, UTC).isoformat(timespec="seconds") if key.revoked else None,
    }
