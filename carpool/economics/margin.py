"""Margin on the dashboard (`carpool serve --hourly-price P`): what each tier and tenant paid since the server
started (today, UTC, at most) against what the machine cost over the same time, and the tiers whose list price
is below a token's cost at the utilization the server has measured.

The machine's cost over a window is the hourly price times its length, busy or idle: an idle hour is paid for
too, and carried by whoever the machine served. It is shared by each group's estimated busy time: its computed
prompt tokens and output tokens, each model's at that model's measured seconds per token (the engine's phase
meters, carpool.economics.phase_meter). So a tier's margin is its revenue less its share of the bill: negative at
low utilization however the prices are set, which is what an operator choosing prices needs to see.
"""

import time
from dataclasses import dataclass

from carpool.economics.cost_model import SECONDS_PER_HOUR, machine_cost_per_1m
from carpool.economics.keys import ANONYMOUS
from carpool.economics.phase_meter import PhaseMeter, PhaseTotals
from carpool.economics.prices import PriceSheet
from carpool.economics.reports import GROUP_BY
from carpool.engine.tiers import TIER_NAMES


@dataclass
class MachineBill:
    """What margins are computed against: the machine's price, when the server started, each model's meter."""

    hourly_price: float
    started: float  # unix seconds
    phases: dict[str, PhaseMeter]
    prices: PriceSheet


def seconds_per_token(totals: PhaseTotals) -> tuple[float, float]:
    """(busy seconds per computed prompt token, per output token) measured so far; 0 where nothing ran."""
    prefill = totals.prefill_seconds / totals.prefill_tokens if totals.prefill_tokens else 0.0
    decode = totals.decode_seconds / totals.decode_tokens if totals.decode_tokens else 0.0
    return prefill, decode


def margins(conn, bill: MachineBill, window_start: float, now: float | None = None) -> dict:
    """The dashboard's margin panel over [max(window_start, bill.started), now): per tier and per tenant their
    revenue (the ledger's cost), machine cost and margin; the measured utilization; and per model, the tiers whose
    list output price is below an output token's machine cost at that utilization."""
    now = time.time() if now is None else now
    start = max(window_start, bill.started)
    totals = {model: meter.totals() for model, meter in bill.phases.items()}
    rates = {model: seconds_per_token(t) for model, t in totals.items()}
    elapsed = max(now - bill.started, 1e-9)
    busy = sum(t.prefill_seconds + t.decode_seconds for t in totals.values())
    utilization = min(busy / elapsed, 1.0)
    machine_cost = bill.hourly_price * (now - start) / SECONDS_PER_HOUR
    groups = {name: _busy_and_revenue(conn, name, start, now, rates) for name in ("tier", "tenant")}
    all_busy = sum(estimate for estimate, _ in groups["tier"].values())
    panel = {
        "hourly_price": bill.hourly_price,
        "since": start,
        "machine_cost": machine_cost,
        "utilization": utilization,
        "below_cost": _below_cost(bill, totals, utilization),
    }
    for name, rows in groups.items():
        panel[f"by_{name}"] = [
            {
                name: group,
                "revenue": revenue,
                "machine_cost": machine_cost * estimate / all_busy if all_busy else 0.0,
                "margin": revenue - (machine_cost * estimate / all_busy if all_busy else 0.0),
            }
            for group, (estimate, revenue) in sorted(rows.items(), key=lambda item: -item[1][1])
        ]
    return panel


def _busy_and_revenue(conn, group_by: str, start: float, end: float, rates: dict) -> dict:
    """{group: (estimated busy seconds, revenue)} of the ledger's rows in [start, end)."""
    column = GROUP_BY[group_by]  # from the fixed map, never from the caller
    rows = conn.execute(
        f"SELECT {column}, model, SUM(uncached_prompt_tokens), SUM(output_tokens), SUM(cost) FROM ledger"
        f" WHERE time >= ? AND time < ? GROUP BY {column}, model",
        (start, end),
    ).fetchall()
    found: dict[str, tuple[float, float]] = {}
    for group, model, prompt_tokens, output_tokens, revenue in rows:
        prefill, decode = rates.get(model, (0.0, 0.0))
        group = ANONYMOUS if group is None else group
        estimate, paid = found.get(group, (0.0, 0.0))
        found[group] = (estimate + prompt_tokens * prefill + output_tokens * decode, paid + revenue)
    return found


def _below_cost(bill: MachineBill, totals: dict[str, PhaseTotals], utilization: float) -> list[dict]:
    """Per model, each tier whose list output price is below an output token's machine cost at the measured
    utilization (busy rate times utilization: the tokens an hour actually brings)."""
    found = []
    for model, t in totals.items():
        if not t.decode_seconds or not utilization:
            continue
        cost = machine_cost_per_1m(bill.hourly_price, t.decode_tokens / t.decode_seconds * utilization)
        listed = bill.prices.price(model).output
        for tier in TIER_NAMES:
            price = listed * bill.prices.tier_multiplier(tier)
            if price < cost:
                found.append({"model": model, "tier": tier, "list_output_per_1m": price, "cost_output_per_1m": cost})
    return found
