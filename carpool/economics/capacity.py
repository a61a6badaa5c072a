"""`carpool capacity plan`: the next hour's traffic forecast from the ledger's days, and the replicas it needs,
started ahead of each rise by a replica's start time (seed 000: pre-warm before the predictable peak, merge in
the valleys).

The forecast is seasonal: the traffic of each minute of the day (UTC), per tier, averaged over the last `days`
days (since the ledger began; a day without traffic counts as zero), smoothed over a few minutes either side. A minute's work is its
computed prompt tokens and output tokens at the machine's measured seconds per token (the engine's phase meters,
as `carpool cost model` reads them), and a replica is planned for every `60 x target utilization` busy seconds a
minute brings. The Batch API's tier is not sized for: it waits for spare time (its tokens are reported apart).
"""

import itertools
import math
import time
from dataclasses import dataclass

from carpool.economics.margin import seconds_per_token
from carpool.economics.phase_meter import PhaseTotals
from carpool.engine.tiers import BATCH_TIER

DAY = 86400
PROFILE_DAYS = 7  # the days a minute's traffic is averaged over, by default
MINUTES_PER_DAY = DAY // 60


@dataclass(frozen=True)
class Traffic:
    """A minute's traffic: requests, computed prompt tokens and output tokens."""

    requests: float = 0.0
    prompt_tokens: float = 0.0
    output_tokens: float = 0.0

    def __add__(self, other: "Traffic") -> "Traffic":
        return Traffic(
            self.requests + other.requests,
            self.prompt_tokens + other.prompt_tokens,
            self.output_tokens + other.output_tokens,
        )

    def scaled(self, factor: float) -> "Traffic":
        return Traffic(self.requests * factor, self.prompt_tokens * factor, self.output_tokens * factor)


@dataclass(frozen=True)
class PlannedMinute:
    at: float  # unix seconds of the minute's start
    live: Traffic  # every tier but the Batch API's
    batch: Traffic
    busy_seconds: float  # the live traffic's machine time
    replicas: int


def daily_profile(conn, at: float, days: int, model: str | None = None) -> dict[tuple[int, bool], Traffic]:
    """{(minute of the day, is the Batch API's tier): the mean traffic of that minute} over the `days` days before
    `at`, of `model` (None: every model). A minute's mean is over the times it occurred in that window since the
    ledger's first day (a ledger three days old is averaged over three days, not seven; a day without traffic
    counts as zero). A row's arrival is its `arrived`, or for a row written before that column, its end less its
    timings."""
    of_model = "" if model is None else " AND model = ?"
    rows = conn.execute(
        "SELECT COALESCE(arrived, time - queue_seconds - prefill_seconds - decode_seconds), tier,"
        f" uncached_prompt_tokens, output_tokens FROM ledger WHERE time >= ? AND time < ?{of_model}",
        (at - days * DAY, at, *(() if model is None else (model,))),
    ).fetchall()
    if not rows:
        return {}
    window_start = max(at - days * DAY, min(row[0] for row in rows) // DAY * DAY)
    totals: dict[tuple[int, bool], Traffic] = {}
    for arrived, tier, prompt_tokens, output_tokens in rows:
        slot = (int(arrived % DAY // 60), tier == BATCH_TIER)
        totals[slot] = totals.get(slot, Traffic()) + Traffic(1.0, prompt_tokens, output_tokens)
    return {slot: traffic.scaled(1 / _occurrences(slot[0], window_start, at)) for slot, traffic in totals.items()}


def _occurrences(minute: int, start: float, end: float) -> int:
    """How many times the minute of the day `minute` began in [start, end) (at least once: it has traffic)."""
    first = start // DAY * DAY + minute * 60
    if first < start:
        first += DAY
    return max(1, math.ceil((end - first) / DAY)) if first < end else 1


def plan(
    conn,
    phases: PhaseTotals,
    *,
    model: str | None = None,
    at: float | None = None,
    days: int = PROFILE_DAYS,
    horizon_minutes: int = 60,
    smooth_minutes: int = 5,
    target_utilization: float = 0.7,
    min_replicas: int = 1,
    max_replicas: int = 64,
) -> list[PlannedMinute]:
    """The forecast and replica count of each minute from `at` (default: now, to the minute) on, for the traffic
    of `model` (None: every model's, all at `phases`' rates)."""
    if not 0 < target_utilization <= 1:
        raise ValueError(f"target_utilization must be in (0, 1], got {target_utilization}")
    if days < 1 or horizon_minutes < 1 or smooth_minutes < 0:
        raise ValueError("days and horizon_minutes must be at least 1, smooth_minutes at least 0")
    if not 1 <= min_replicas <= max_replicas:
        raise ValueError(f"replicas: need 1 <= min ({min_replicas}) <= max ({max_replicas})")
    start = (time.time() if at is None else at) // 60 * 60
    profile = daily_profile(conn, start, days, model)
    prefill, decode = seconds_per_token(phases)
    if not decode:
        raise ValueError("the measurements hold no decode time: measure a server that has served traffic")
    planned = []
    for step in range(horizon_minutes):
        minute = int((start // 60 + step) % MINUTES_PER_DAY)
        live, batch = (_smoothed(profile, minute, smooth_minutes, is_batch) for is_batch in (False, True))
        busy = live.prompt_tokens * prefill + live.output_tokens * decode
        replicas = min(max(math.ceil(busy / (60 * target_utilization) - 1e-9), min_replicas), max_replicas)
        planned.append(PlannedMinute(start + step * 60, live, batch, busy, replicas))
    return planned


def forecast_against_actual(
    conn, now: float, profile: dict | None = None, minutes: int = 60, days: int = PROFILE_DAYS, smooth_minutes: int = 5
) -> dict:
    """The dashboard's traffic panel: live requests a minute over the last and the next `minutes` minutes, as
    forecast from the days before today (so today's own traffic never forecasts itself) and, for those past, as
    they came. `profile`: daily_profile(conn, today's midnight, days), which changes once a day (the dashboard
    keeps it rather than read a week of rows at each refresh)."""
    now_minute = now // 60 * 60
    if profile is None:
        profile = daily_profile(conn, now // DAY * DAY, days)
    times = [now_minute + 60 * step for step in range(-minutes, minutes)]
    forecast = [_smoothed(profile, int(at % DAY // 60), smooth_minutes, False).requests for at in times]
    counts: dict[float, int] = {}
    for (arrived,) in conn.execute(
        "SELECT COALESCE(arrived, time - queue_seconds - prefill_seconds - decode_seconds) FROM ledger"
        " WHERE time >= ? AND tier <> ?",
        (times[0], BATCH_TIER),
    ).fetchall():
        counts[arrived // 60 * 60] = counts.get(arrived // 60 * 60, 0) + 1
    actual = [counts.get(at, 0) if at < now_minute else None for at in times]
    return {"minutes": times, "forecast": forecast, "actual": actual}


def _smoothed(profile: dict, minute: int, width: int, is_batch: bool) -> Traffic:
    total = Traffic()
    for offset in range(-width, width + 1):
        total = total + profile.get(((minute + offset) % MINUTES_PER_DAY, is_batch), Traffic())
    return total.scaled(1 / (2 * width + 1))


def actions(planned: list[PlannedMinute], start_seconds: float) -> list[tuple[float, str]]:
    """(when, what): start replicas `start_seconds` before the minute that needs them (they warm up before they
    take traffic), release them at the minute that no longer does."""
    found = []
    for before, minute in itertools.pairwise(planned):
        change, clock = minute.replicas - before.replicas, _clock(minute.at)
        if change > 0:
            found.append((minute.at - start_seconds, f"start {change} replica(s): {minute.replicas} needed at {clock}"))
        elif change < 0:
            found.append((minute.at, f"release {-change} replica(s): {minute.replicas} enough from {clock}"))
    return found


def _clock(at: float) -> str:
    return time.strftime("%H:%M", time.gmtime(at))


def render(planned: list[PlannedMinute], start_seconds: float, every: int = 5) -> str:
    header = (
        f"{'UTC':<6} {'req/min':>8} {'prompt tok/min':>15} {'output tok/min':>15} {'busy s/min':>11} "
        f"{'batch tok/min':>14} {'replicas':>8}"
    )
    lines = [header]
    for minute in planned[::every]:
        live, batch = minute.live, minute.batch
        lines.append(
            f"{_clock(minute.at):<6} {live.requests:>8.1f} {live.prompt_tokens:>15,.0f} {live.output_tokens:>15,.0f}"
            f" {minute.busy_seconds:>11.1f} {batch.prompt_tokens + batch.output_tokens:>14,.0f} {minute.replicas:>8}"
        )
    steps = actions(planned, start_seconds)
    lines.append("")
    lines += [f"{time.strftime('%H:%M:%S', time.gmtime(when))}  {what}" for when, what in steps] or ["no change"]
    return "\n".join(lines)
