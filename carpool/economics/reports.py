"""Usage reports from the ledger: tokens, cost and where the time went, grouped by key, tenant, model or tier.

Shared by `GET /v1/usage` and `carpool cost report`, so both always agree.
"""

import csv
import io
import json
import sqlite3
from dataclasses import asdict, dataclass
from datetime import datetime, timezone

from carpool.economics.keys import ANONYMOUS

GROUP_BY = {"key": "key_id", "tenant": "tenant", "model": "model", "tier": "tier"}
FORMATS = ("table", "csv", "json")


@dataclass
class UsageSummary:
    group: str
    requests: int
    uncached_prompt_tokens: int
    cache_read_tokens: int
    cache_write_tokens: int
    output_tokens: int
    cost: float
    prefill_seconds: float
    decode_seconds: float

    @property
    def total_tokens(self) -> int:
        return self.uncached_prompt_tokens + self.cache_read_tokens + self.output_tokens

    @property
    def cost_per_1k_tokens(self) -> float:
        return self.cost / self.total_tokens * 1000 if self.total_tokens else 0.0

    @property
    def cache_hit_share(self) -> float:
        """Share of prompt tokens read from the prefix cache."""
        prompt = self.uncached_prompt_tokens + self.cache_read_tokens
        return self.cache_read_tokens / prompt if prompt else 0.0

    @property
    def prefill_share(self) -> float:
        """Share of the requests' compute time spent in prefill (the rest is decode)."""
        busy = self.prefill_seconds + self.decode_seconds
        return self.prefill_seconds / busy if busy else 0.0

    @property
    def decode_share(self) -> float:
        busy = self.prefill_seconds + self.decode_seconds
        return self.decode_seconds / busy if busy else 0.0

    def as_dict(self) -> dict:
        derived = ("total_tokens", "cost_per_1k_tokens", "cache_hit_share", "prefill_share", "decode_share")
        return asdict(self) | {name: getattr(self, name) for name in derived}


def usage_summary(
    conn: sqlite3.Connection, group_by: str, start: float | None = None, end: float | None = None
) -> list[UsageSummary]:
    """One row per group over ledger rows with start <= time < end (either bound may be open), dearest first."""
    if group_by not in GROUP_BY:
        raise ValueError(f"group_by must be one of {', '.join(GROUP_BY)}, got {group_by!r}")
    column = GROUP_BY[group_by]  # from the fixed map above, never from the caller
    rows = conn.execute(
        f"SELECT {column}, COUNT(*), SUM(uncached_prompt_tokens), SUM(cache_read_tokens), SUM(cache_write_tokens),"
        " SUM(output_tokens), SUM(cost), SUM(prefill_seconds), SUM(decode_seconds) FROM ledger"
        " WHERE time >= ? AND time < ?"
        f" GROUP BY {column} ORDER BY SUM(cost) DESC, {column}",
        (start if start is not None else float("-inf"), end if end is not None else float("inf")),
    )
    return [UsageSummary(group if group is not None else ANONYMOUS, *totals) for group, *totals in rows]


def total(rows: list[UsageSummary]) -> UsageSummary:
    sums = [sum(getattr(row, name) for row in rows) for name in list(UsageSummary.__dataclass_fields__)[1:]]
    return UsageSummary("total", *sums)


def parse_time(text: str) -> float:
    """Unix seconds, or an ISO 8601 date or date-time (UTC unless it says otherwise)."""
    try:
        return float(text)
    except ValueError:
        pass
    try:
        moment = datetime.fromisoformat(text)
    except ValueError:
        raise ValueError(
            f"time must be unix seconds or ISO 8601 (2025-01-31, 2025-01-31T12:00), got {text!r}"
        ) from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=timezone.utc)
    return moment.timestamp()


def report_document(rows: list[UsageSummary], group_by: str, start: float | None, end: float | None) -> dict:
    return {
        "object": "list",
        "group_by": group_by,
        "start": start,
        "end": end,
        "data": [row.as_dict() for row in rows],
        "total": total(rows).as_dict(),
    }


_COLUMNS = (  # (heading, field, format)
    ("requests", "requests", "{:d}"),
    ("uncached_in", "uncached_prompt_tokens", "{:d}"),
    ("cache_read", "cache_read_tokens", "{:d}"),
    ("cache_write", "cache_write_tokens", "{:d}"),
    ("output", "output_tokens", "{:d}"),
    ("tokens", "total_tokens", "{:d}"),
    ("cost_usd", "cost", "{:.6f}"),
    ("usd_per_1k", "cost_per_1k_tokens", "{:.6f}"),
    ("cache_hit", "cache_hit_share", "{:.1%}"),
    ("prefill", "prefill_share", "{:.1%}"),
    ("decode", "decode_share", "{:.1%}"),
)


def render(
    rows: list[UsageSummary], group_by: str, fmt: str, start: float | None = None, end: float | None = None
) -> str:
    if fmt == "json":
        return json.dumps(report_document(rows, group_by, start, end), indent=2)
    if fmt == "csv":
        out = io.StringIO()
        writer = csv.writer(out, lineterminator="\n")
        writer.writerow([group_by, *(field for _, field, _ in _COLUMNS)])
        for row in rows:
            writer.writerow([row.group, *(getattr(row, field) for _, field, _ in _COLUMNS)])
        return out.getvalue()
    if fmt == "table":
        lines = [[group_by, *(heading for heading, _, _ in _COLUMNS)]]
        for row in [*rows, total(rows)]:
            lines.append([row.group, *(style.format(getattr(row, field)) for _, field, style in _COLUMNS)])
        widths = [max(len(line[i]) for line in lines) for i in range(len(lines[0]))]
        # The group name reads left-aligned, the numbers right-aligned.
        aligned = [
            [line[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(line[1:], widths[1:], strict=True)]
            for line in lines
        ]
        return "".join("  ".join(line) + "\n" for line in aligned)
    raise ValueError(f"format must be one of {', '.join(FORMATS)}, got {fmt!r}")
