"""The autoscaling policy of `--replicas MIN:MAX`: Ray Serve calls `policy` in its controller every control-loop
tick, then applies its own delays, scaling factors and the MIN/MAX bounds to the answer (we do not re-implement
any of that), and drains what it removes.

Demand is Ray's own request-based measure, ongoing requests over the per-replica target (the replica's slots), with
one difference: the Batch API's lines are counted apart (each replica reports its live and batch requests through
`record_autoscaling_stats`), because they wait for spare capacity rather than asking for more. While live demand
fills MIN replicas or more, it alone sets the count: a batch backlog never buys replicas in a peak (its lines take
the slots live traffic leaves). In a valley (live demand below MIN replicas) the backlog counts like live work, so
it takes the spare replicas up to MAX and is worked off while the interactive tiers are quiet (issue 52, item 4).
"""

from typing import Any

LIVE_ONGOING = "carpool_live_ongoing"
BATCH_ONGOING = "carpool_batch_ongoing"


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
    target = ctx.config.get_target_ongoing_requests()
    return desired_replicas(live, batch, target, ctx.capacity_adjusted_min_replicas), {}
