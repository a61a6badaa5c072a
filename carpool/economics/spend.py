"""Each key's spend in the current UTC day and month, kept in memory so admission never queries the ledger.

At startup the ledger gives the spend so far in the current day and month; from then on every recorded cost
is added here the moment it is recorded, before its row reaches the disk. A period that starts later began
after startup, so everything spent in it passed through `add`. (One server per database file: another
process's spend is seen only at the next start.)
"""

import sqlite3
import threading
from datetime import UTC, datetime

PERIODS = ("day", "month")


def period_start(period: str, at: float) -> float:
    """Unix time at which the UTC day or month holding `at` began."""
    moment = datetime.fromtimestamp(at, UTC)
    start = moment.replace(hour=0, minute=0, second=0, microsecond=0)
    if period == "month":
        start = start.replace(day=1)
    elif period != "day":
        raise ValueError(f"budget period must be day or month, got {period!r}")
    return start.timestamp()


class SpendTracker:
    def __init__(self, conn: sqlite3.Connection, now: float):
        self._lock = threading.Lock()
        self._periods: dict[str, tuple[float, dict[str | None, float]]] = {}
        for period in PERIODS:
            start = period_start(period, now)
            rows = conn.execute("SELECT key_id, SUM(cost) FROM ledger WHERE time >= ? GROUP BY key_id", (start,))
            self._periods[period] = (start, {key_id: total for key_id, total in rows})

    def add(self, key_id: str | None, cost: float, at: float) -> None:
        with self._lock:
            for period in PERIODS:
                spent = self._current(period, at)
                if spent is not None:
                    spent[key_id] = spent.get(key_id, 0.0) + cost

    def spent(self, key_id: str | None, period: str, now: float) -> float:
        with self._lock:
            spent = self._current(period, now)
            return spent.get(key_id, 0.0) if spent is not None else 0.0

    def _current(self, period: str, at: float) -> dict[str | None, float] | None:
        """The spend map of the period holding `at`, opening a new period when `at` is past the current one;
        None for a period already closed (a request that finished just before midnight, recorded just after)."""
        start, spent = self._periods[period]
        at_start = period_start(period, at)
        if at_start > start:
            start, spent = at_start, {}
            self._periods[period] = (start, spent)
        return spent if at_start == start else None
