"""A bounded queue per service tier: a request counts as queued from admission until its first token, and a
tier whose queue is full refuses newcomers with 429 instead of letting the wait grow without end."""

from collections import Counter

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
