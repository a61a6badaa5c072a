"""The ledger's panels on the server's /dashboard: spend against budget per key, cost per 1K tokens per tenant
today, live requests a minute forecast from the days before against actual (carpool.economics.capacity), and
with `--hourly-price` the margin per tier and tenant (carpool.economics.margin). `carpool serve` hands
`ledger_panels(gate, bill)` to the app; the server calls it on every refresh.

Spend comes from admission's in-memory figures (what budgets are enforced against), so it costs no query. The
per-tenant report is the ledger's own (`carpool cost report --group-by tenant` over today, UTC), at most once
every TENANT_REPORT_SECONDS: it scans today's rows, which a 2 s refresh should not do each time.
"""

import threading
import time
from collections.abc import Callable

from carpool.economics.capacity import DAY, PROFILE_DAYS, daily_profile, forecast_against_actual
from carpool.economics.db import open_database
from carpool.economics.ledger_gate import LedgerGate
from carpool.economics.margin import MachineBill, margins
from carpool.economics.spend import period_start

TENANT_REPORT_SECONDS = 10.0


def ledger_panels(
    gate: LedgerGate, bill: MachineBill | None = None, clock: Callable[[], float] = time.monotonic
) -> Callable[[], dict]:
    lock = threading.Lock()
    cached: dict = {"at": None, "tenants": [], "margin": None, "traffic": None}
    profile: dict = {"day": None, "minutes": None}  # the traffic forecast's, from the days before today

    def tenants_today() -> list[dict]:
        with lock:
            if cached["at"] is None or clock() - cached["at"] >= TENANT_REPORT_SECONDS:
                rows = gate.usage("tenant", start=period_start("day", gate.clock()))
                cached["tenants"] = [
                    {
                        "tenant": row.group,
                        "requests": row.requests,
                        "tokens": row.total_tokens,
                        "cost": row.cost,
                        "cost_per_1k_tokens": row.cost_per_1k_tokens,
                    }
                    for row in rows
                ]
                cached["margin"], cached["traffic"] = from_the_ledger()
                cached["at"] = clock()
            return cached["tenants"]

    def from_the_ledger() -> tuple[dict | None, dict]:
        """(the margin panel, with an hourly price; the traffic panel: forecast against actual)."""
        conn = open_database(gate.db_path)
        try:
            now = gate.clock()
            margin = margins(conn, bill, period_start("day", now), now) if bill else None
            if profile["day"] != now // DAY:
                profile["day"], profile["minutes"] = now // DAY, daily_profile(conn, now // DAY * DAY, PROFILE_DAYS)
            return margin, forecast_against_actual(conn, now, profile["minutes"])
        finally:
            conn.close()

    def panels() -> dict:
        budgets = []
        for key, spent in gate.key_spend():
            period = key.budget_period or "day"
            budgets.append(
                {
                    "key_id": key.key_id,
                    "tenant": key.tenant,
                    "scopes": sorted(key.scopes),
                    "budget": key.budget,
                    "period": period,
                    "spent": spent[period],
                }
            )
        tenants = tenants_today()
        return {"budgets": budgets, "tenants": tenants, "margin": cached["margin"], "traffic": cached["traffic"]}

    return panels
