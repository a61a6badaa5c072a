"""The ledger's panels on the server's /dashboard: spend against budget per key, and cost per 1K tokens per
tenant today. `carpool serve` hands `ledger_panels(gate)` to the app; the server calls it on every refresh.

Spend comes from admission's in-memory figures (what budgets are enforced against), so it costs no query. The
per-tenant report is the ledger's own (`carpool cost report --group-by tenant` over today, UTC), at most once
every TENANT_REPORT_SECONDS: it scans today's rows, which a 2 s refresh should not do each time.
"""

import threading
import time
from collections.abc import Callable

from carpool.economics.ledger_gate import LedgerGate
from carpool.economics.spend import period_start

TENANT_REPORT_SECONDS = 10.0


def ledger_panels(gate: LedgerGate, clock: Callable[[], float] = time.monotonic) -> Callable[[], dict]:
    lock = threading.Lock()
    cached: dict = {"at": None, "tenants": []}

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
                cached["at"] = clock()
            return cached["tenants"]

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
        return {"budgets": budgets, "tenants": tenants_today()}

    return panels
