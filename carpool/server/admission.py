"""A bounded queue per service tier: a request counts as queued from admission until its first token, and a
tier whose queue is full refuses newcomers with 429 instead of letting the wait grow without end."""

from collections import Counter

from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily

from carpool.engine.tiers import TIER_NAMES
from carpool.server.errors import APIError

RETRY_AFTER_SECONDS = 1.0


class TierQueues:
    def __init__(self, limit: int):
        if limit <= 0:
            raise ValueError(f"max_queued_per_tier must be a positive integer, got {limit!r}")
        self.limit = limit
        self.queued: Counter[str] = Counter()

    def reserve(self, tier: str, count: int) -> None:
        if self.queued[tier] + count > self.limit:
            raise APIError(
                429,
                f"The {tier} tier's queue is full ({self.queued[tier]} of {self.limit} requests waiting); retry later.",
                code="rate_limit_exceeded",
                retry_after=RETRY_AFTER_SECONDS,
            )
        self.queued[tier] += count

    def release(self, tier: str) -> None:
        self.queued[tier] -= 1


def register_queue_metrics(registry: CollectorRegistry, queues: dict[str, TierQueues]) -> None:
    """Export `carpool:num_requests_queued{model_name, tier}`: each model's tier queues, read at scrape time."""
    registry.register(_QueueCollector(queues))


class _QueueCollector:
    def __init__(self, queues: dict[str, TierQueues]):
        self.queues = queues

    def collect(self):
        """The prometheus_client collector interface."""
        family = GaugeMetricFamily(
            "carpool:num_requests_queued",
            "Requests admitted and waiting for their first "
            "token, by service tier (the queue that answers 429 once full).",
            labels=["model_name", "tier"],
        )
        for model_name, queues in self.queues.items():
            for tier in TIER_NAMES:
                family.add_metric([model_name, tier], queues.queued[tier])
        yield family
