"""The budget check both admissions share (one process's LocalAdmission, replicas' SharedAdmission), and dollars as
its messages print them.

Each admitted request reserves its worst case (PriceSheet.worst_case_cost: its prompt and max_tokens at the
dearest rate it could be charged) until its ledger row settles the real cost, so a request is admitted only
while spent + reserved + its own worst case stays within the budget: requests admitted together can never
overshoot it, however many arrive at once.
"""

import math

from carpool.economics.contract import GateError
from carpool.economics.keys import ApiKey

SIGNIFICANT_DIGITS = 4


def dollars(amount: float) -> str:
    """`$` and the amount to SIGNIFICANT_DIGITS (at least cents): a budget of $0.00006 prints as $0.00006, not
    as the $0.0001 four fixed decimals made of it, which read as more than was spent against it."""
    if amount == 0 or not math.isfinite(amount):
        return f"${amount:.2f}"
    decimals = max(2, SIGNIFICANT_DIGITS - 1 - math.floor(math.log10(abs(amount))))
    text = f"{amount:.{decimals}f}"
    whole, _, fraction = text.partition(".")
    return f"${whole}.{fraction.rstrip('0').ljust(2, '0')}"


def check_budget(key: ApiKey, spent: float, reserved: float, estimated_cost: float) -> None:
    """Raise GateError 429 unless `estimated_cost` fits in what `key`'s budget has left after `spent` and what
    requests in flight have `reserved`. Only for a key with a budget."""
    period = key.budget_period
    if spent + reserved >= key.budget:
        in_flight = f" (and requests in flight may spend {dollars(reserved)})" if reserved > 0 else ""
        raise GateError(
            429,
            f"This key has spent {dollars(spent)}{in_flight} of its budget of {dollars(key.budget)} per {period}.",
            "insufficient_quota",
        )
    if spent + reserved + estimated_cost > key.budget:
        left = key.budget - spent - reserved
        raise GateError(
            429,
            f"max_tokens: this request may cost up to {dollars(estimated_cost)} (its prompt and max_tokens at the "
            f"dearest rate it could be charged), more than the {dollars(left)} left of this key's budget of "
            f"{dollars(key.budget)} per {period}; lower max_tokens, or retry once requests in flight finish.",
            "insufficient_quota",
            param="max_tokens",
        )
