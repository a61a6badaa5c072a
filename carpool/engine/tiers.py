"""The service tiers, stated once: the API's `service_tier` and `priority`, the scheduler's order, the price
sheet's multipliers, the tier labels on metrics and ledger rows all come from this table."""

from dataclasses import dataclass


@dataclass(frozen=True)
class Tier:
    name: str
    # Scheduling priority: lower is served first, preempts higher when memory or sequence slots run out, and
    # is the number the API's `priority` field names.
    priority: int
    # What a request in this tier costs, as a multiplier on its whole price, unless the price sheet's [tiers]
    # says otherwise.
    price_multiplier: float
    # Queue policy. A live tier is one a request may ask for (`service_tier`, `priority`); the others are
    # reached another way (the Batch API). A background tier's decodes sit out any step that computes a
    # foreground tier's prompt, so background work never lengthens an interactive time to first token.
    live: bool = True
    background: bool = False


TIERS = (
    Tier("priority", priority=0, price_multiplier=2.0),
    Tier("default", priority=1, price_multiplier=1.0),
    Tier("flex", priority=2, price_multiplier=0.5),
    Tier("batch", priority=3, price_multiplier=0.5, live=False, background=True),
)
TIER_NAMES = tuple(tier.name for tier in TIERS)
LIVE_TIERS = tuple(tier for tier in TIERS if tier.live)
BY_NAME = {tier.name: tier for tier in TIERS}
BY_PRIORITY = {tier.priority: tier for tier in TIERS}
DEFAULT_TIER = "default"  # what a request that names no tier gets
BATCH_TIER = "batch"  # where the Batch API runs its lines
# Every tier at or below this priority number is background: one threshold the scheduler compares against.
BACKGROUND_PRIORITY = min(tier.priority for tier in TIERS if tier.background)
