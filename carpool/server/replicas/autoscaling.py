"""The autoscaling policy of `--replicas MIN:MAX`: Ray Serve calls `policy` in its controller every control-loop
tick, then applies its own delays, scaling factors and the MIN/MAX bounds to the answer (we do not re-implement
any of that), and drains what it removes.

Demand is Ray's own request-based measure, ongoing requests over a per-replica target, with two differences. The
target is what a replica carries at its SLO: each replica with an ITL SLO (`--slo-itl-ms`) reports its SLO
controller's live capacity (the decode batch whose step fits the tightest ITL SLO, carpool.engine.slo), and the
policy takes their mean; without an SLO it is Ray's configured target, the replica's slots. And the Batch API's
lines are counted apart (each replica reports its batch requests through
`record_autoscaling_stats`), because they wait for spare capacity rather than asking for more. While live demand
fills MIN replicas or more, it alone sets the count: a batch backlog never buys replicas in a peak (its lines take
the slots live traffic leaves). In a valley (live demand below MIN replicas) the backlog counts like live work, so
it takes the spare replicas up to MAX and is worked off while the interactive tiers are quiet (issue 52, item 4).

With `--capacity-plan FILE` (`carpool capacity plan --format json`, re-run by a timer to keep it current) the
policy is `PlannedPolicy`: the same answer, but never below the plan's replicas for the minute ahead, each minute's
count raised `replica_start_seconds` (and Ray's upscale delay and metrics tick) before it begins, so a forecast peak
finds its replicas loaded and warm.
"""

import json
import logging
import os
import time
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

BATCH_ONGOING = "carpool_batch_ongoing"
LIVE_CAPACITY = "carpool_live_capacity"


def desired_replicas(live_ongoing: float, batch_ongoing: float, target_ongoing: float, min_replicas: int) -> float:
    """Replicas wanted (before Ray's delays and bounds) for these ongoing requests across the deployment."""
    live = live_ongoing / target_ongoing
    if live >= min_replicas:
        return live
    return max(live, (live_ongoing + batch_ongoing) / target_ongoing)


def policy(ctx) -> tuple[float, dict[str, Any]]:
    """Ray Serve's custom-policy entry point (an AutoscalingContext in, replicas and policy state out)."""
    if ctx.current_num_replicas == 0:  # starting, or every replica restarting: Ray's own answer
        return ctx.target_num_replicas, {}
    batch = sum((ctx.aggregated_metrics or {}).get(BATCH_ONGOING, {}).values())
    # Ray's total (the handles' count, queued ones included) less the batch lines the replicas report; a replica
    # that has not reported yet leaves its batch lines counted as live, which errs towards capacity.
    live = max(0.0, ctx.total_num_requests - batch)
    capacities = list((ctx.aggregated_metrics or {}).get(LIVE_CAPACITY, {}).values())
    target = sum(capacities) / len(capacities) if capacities else ctx.config.get_target_ongoing_requests()
    return desired_replicas(live, batch, target, ctx.capacity_adjusted_min_replicas), {}


def plan_floor(document: dict, at: float) -> int:
    """The replicas a capacity plan wants up at `at`: each minute's count from `replica_start_seconds` before the
    minute (a replica loads and warms up before it takes traffic) to its end; 0 outside the plan. A plan's minutes
    are 60 s unless it says `minute_seconds` (the trace bench's compressed day: a "minute" of 20 s)."""
    lead, length = document.get("replica_start_seconds", 0.0), document.get("minute_seconds", 60.0)
    return max((m["replicas"] for m in document["minutes"] if m["at"] - lead <= at < m["at"] + length), default=0)


def read_plan(path: str) -> dict:
    """A `carpool capacity plan --format json` document; ValueError naming --capacity-plan when it is not one."""
    try:
        document = json.loads(Path(path).read_text(encoding="utf-8"))
        for minute in document["minutes"]:
            float(minute["at"]), int(minute["replicas"])
        if float(document.get("minute_seconds", 60.0)) <= 0:
            raise ValueError(f"minute_seconds must be positive, got {document['minute_seconds']!r}")
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise ValueError(
            f"--capacity-plan: {path} is not a `carpool capacity plan --format json` file: {error!r}"
        ) from None
    return document


class PlannedPolicy:
    """`policy` with a floor from a capacity plan file, read again whenever it changes. Ray's controller makes one
    (with the deployment's policy_kwargs) and calls it every control-loop tick; the floor then goes through Ray's
    delays and bounds like any answer."""

    def __init__(self, plan: str):
        self.path, self.document, self.mtime = plan, {"minutes": []}, None

    def __call__(self, ctx) -> tuple[float, dict[str, Any]]:
        desired, state = policy(ctx)
        # The floor is read that far ahead: Ray acts on it only after its upscale delay and a metrics tick, and
        # the plan's start time is the replica's own (load and warm-up). Without it the simulated day's pre-warmed
        # replicas came up 2-3 s into the minute they were planned for (carpool bench simulate --day).
        ahead = ctx.config.upscale_delay_s + ctx.config.metrics_interval_s
        return max(desired, plan_floor(self._plan(), (ctx.current_time or time.time()) + ahead)), state

    def _plan(self) -> dict:
        try:
            mtime = os.stat(self.path).st_mtime
        except OSError:
            mtime = None
        if mtime != self.mtime:  # read once per change: a bad re-plan warns once, and the last good plan stands
            self.mtime = mtime
            try:
                self.document = read_plan(self.path)
            except ValueError as error:
                log.warning("the capacity plan was not read again, the last one stands: %s", error)
        return self.document
