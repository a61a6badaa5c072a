"""Usage reports from the ledger: tokens, cost and where the time went, grouped by key, tenant, model or tier.

Shared by `GET /v1/usage` and `carpool cost report`, so both always agree.
"""

import csv
import io
import json
import sqlite3
from dataclasses import asdict, dataclass
from datetime import UTC, datetime

from carpool.economics.contract import UsageRecord
from carpool.economics.keys import ANONYMOUS

GROUP_BY = {"key": "key_id", "tenant": "tenant", "model": "model", "tier": "tier"}
FORMATS = ("table", "csv", "json")


@dataclass
class UsageSummary:
    group: str
    requests: int
    uncached_prompt_tokens: int
    cache_read_tokens: int
    cache_write_tokens: int  # automatic writes
    cache_write_5m_tokens: int  # writes under a 5-minute TTL pin
    cache_write_1h_tokens: int  # writes under a 1-hour TTL pin
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
        " SUM(cache_write_5m_tokens), SUM(cache_write_1h_tokens), SUM(output_tokens), SUM(cost), SUM(prefill_seconds), SUM(decode_seconds) FROM ledger"
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
        moment = moment.replace(tzinfo=UTC)
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
    ("write_5m", "cache_write_5m_tokens", "{:d}"),
    ("write_1h", "cache_write_1h_tokens", "{:d}"),
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


# Cascades ------------------------------------------------------------------------------------------------------
# Each attempt of a cascade request is its own ledger row (purpose 'cascade_attempt'), tied to the client request
# by parent_request_id; the row whose cascade_accepted is 1 is the answer the client got.


@dataclass
class CascadeSummary:
    cascade: str
    requests: int  # client requests (distinct parent_request_id)
    answered: dict[int, int]  # step -> requests that step answered
    models: dict[int, str]  # step -> the model seen at that step
    cost: float  # every attempt, escalated ones included
    cost_all_last: float  # estimate: every request sent straight to the last step's model (see cascade_summary)

    @property
    def saved(self) -> float:
        return self.cost_all_last - self.cost

    @property
    def saved_share(self) -> float:
        return self.saved / self.cost_all_last if self.cost_all_last else 0.0

    def as_dict(self) -> dict:
        shares = {str(step): count / self.requests for step, count in self.answered.items()}
        return asdict(self) | {"answered_share": shares, "saved": self.saved, "saved_share": self.saved_share}


def cascade_summary(
    conn: sqlite3.Connection, prices, start: float | None = None, end: float | None = None
) -> list[CascadeSummary]:
    """One row per cascade over attempts with start <= time < end.

    "Saved" is estimated per client request against sending it to the last model alone: a request the last step
    answered would have cost what that attempt cost; one answered earlier is priced by `prices` (a PriceSheet) as
    if the last model had served the accepted attempt's very tokens (prompt, cache reads and writes, as many
    output tokens) in its tier. The last model is the one seen at the cascade's highest step in the window: if no
    request reached the real last step, savings are against the strongest step that ran."""
    rows = conn.execute(
        "SELECT cascade, parent_request_id, cascade_step, cascade_accepted, model, tier, uncached_prompt_tokens,"
        " cache_read_tokens, cache_write_tokens, output_tokens, cost, key_id FROM ledger"
        " WHERE purpose = 'cascade_attempt' AND time >= ? AND time < ? ORDER BY cascade, key_id, parent_request_id,"
        " cascade_step",
        (start if start is not None else float("-inf"), end if end is not None else float("inf")),
    ).fetchall()
    by_cascade: dict[str, list] = {}
    for row in rows:
        by_cascade.setdefault(row[0], []).append(row)
    summaries = []
    for name, attempts in sorted(by_cascade.items()):
        models = {step: model for _, _, step, _, model, *_ in attempts}
        last_step = max(models)
        requests: dict[tuple, list] = {}
        for attempt in attempts:  # parent_request_id is the client's own x-request-id: two keys may send the same
            requests.setdefault((attempt[11], attempt[1]), []).append(attempt)
        answered, cost_all_last = {step: 0 for step in sorted(models)}, 0.0
        for parts in requests.values():
            accepted = next((a for a in parts if a[3]), parts[-1])  # an aborted request: its latest attempt
            _, _, step, _, _, tier, uncached, cache_read, cache_write, output, cost, _ = accepted
            answered[step] += 1 if accepted[3] else 0
            if step == last_step:
                cost_all_last += cost
            else:
                cost_all_last += prices.cost(
                    UsageRecord(
                        "estimate",
                        models[last_step],
                        tier,
                        uncached + cache_read,
                        cache_read,
                        cache_write,
                        output,
                        0.0,
                        0.0,
                        0.0,
                        "stop",
                    )
                )
        summaries.append(
            CascadeSummary(name, len(requests), answered, models, sum(a[10] for a in attempts), cost_all_last)
        )
    return summaries


def render_cascades(rows: list[CascadeSummary], fmt: str) -> str:
    if fmt == "json":
        return json.dumps({"object": "list", "data": [row.as_dict() for row in rows]}, indent=2)
    if fmt != "table":
        raise ValueError(f"format must be table or json, got {fmt!r}")
    lines = []
    for row in rows:
        shares = ", ".join(
            f"step {step} ({row.models[step]}) {count / row.requests:.1%}" for step, count in row.answered.items()
        )
        lines.append(
            f"{row.cascade}: {row.requests} requests; answered by {shares}; cost ${row.cost:.6f}; "
            f"all to {row.models[max(row.models)]} (est.) ${row.cost_all_last:.6f}; "
            f"saved ${row.saved:.6f} ({row.saved_share:.1%})"
        )
    return "\n".join(lines) + ("\n" if lines else "no cascade requests in this window\n")
