"""A price sheet that covers the machine: from the cost model's measured cost per token, the share of the hour the
machine is busy, and a margin.

The cost model prices a token by the machine time it took at full load (busy time only). A machine rented by the
hour is also paid while idle, so at a utilization U (the share of the hour it is busy) each token carries 1/U of
that cost: a model's suggested input and output prices are `cost at full load / U x (1 + margin)`, for the
default tier (multiplier 1). The tiers keep their multipliers and the cache its multipliers, as the sheet had
them: each tier is shown with the utilization at which its price breaks even, since a cheaper tier (flex, batch)
only covers the machine when it runs in time that would otherwise be idle.
"""

import math
from dataclasses import dataclass

from carpool.economics.cost_model import CostModel, machine_cost_per_1m
from carpool.economics.prices import ModelPrice, PriceSheet
from carpool.engine.tiers import TIER_NAMES


@dataclass(frozen=True)
class TierBreakEven:
    """Utilization: the share of the hour the machine must be busy for the tier's list price to cover it."""

    tier: str
    multiplier: float
    input_utilization: float
    output_utilization: float


@dataclass(frozen=True)
class SuggestedPrices:
    model: CostModel
    utilization: float
    margin: float
    cost: ModelPrice  # the measured model's machine cost per 1M tokens at full load (busy time)
    price: ModelPrice  # its suggested default-tier price
    tiers: list[TierBreakEven]

    def below_cost(self, tier: TierBreakEven) -> bool:
        """Whether the tier's list price misses the machine's cost at the target utilization."""
        return max(tier.input_utilization, tier.output_utilization) > self.utilization


def suggest(model: CostModel, prices: PriceSheet, utilization: float, margin: float) -> SuggestedPrices:
    if not 0 < utilization <= 1:
        raise ValueError(f"target utilization must be in (0, 1], got {utilization}")
    if margin < 0:
        raise ValueError(f"margin must not be negative, got {margin}")
    cost = ModelPrice(
        machine_cost_per_1m(model.hourly_price, model.prefill_tokens_per_second),
        machine_cost_per_1m(model.hourly_price, model.decode_tokens_per_second),
    )
    scale = (1 + margin) / utilization
    listed = prices.price(model.model)
    tiers = []
    for tier in TIER_NAMES:
        multiplier = prices.tier_multiplier(tier)
        tiers.append(
            TierBreakEven(
                tier,
                multiplier,
                _break_even(cost.input, listed.input * multiplier),
                _break_even(cost.output, listed.output * multiplier),
            )
        )
    return SuggestedPrices(model, utilization, margin, cost, ModelPrice(cost.input * scale, cost.output * scale), tiers)


def _break_even(cost: float, price: float) -> float:
    """The utilization at which `price` covers `cost` (both per 1M tokens at full load); a free price never does."""
    return cost / price if price > 0 else math.inf


def sheet_toml(suggested: SuggestedPrices, prices: PriceSheet, when: str) -> str:
    """The suggested sheet, loadable by `--prices`: the measured model's new prices, every other entry of the
    current sheet as it was."""
    m = suggested.model
    models = dict(prices.models) | {m.model: suggested.price}
    lines = [
        f"# Suggested by `carpool cost prices` on {when}: {m.model} on {m.hardware.device} at ${m.hourly_price:g}/hour,",
        f"# target utilization {suggested.utilization:g}, margin {suggested.margin:g}. Measured (busy time): prefill",
        f"# {m.prefill_tokens_per_second:,.0f} tokens/s, decode {m.decode_tokens_per_second:,.1f} tokens/s.",
        f"# Other entries are {prices.source}'s, unchanged.",
        "",
        "[cache]",
        f"read = {prices.cache_read:g}",
        f"write = {prices.cache_write:g}",
        f"write_1h = {prices.cache_write_1h:g}",
        f"min_tokens = {prices.cache_min_tokens}",
        "",
        "[tiers]",
        *(f"{tier} = {multiplier:g}" for tier, multiplier in prices.tiers.items()),
    ]
    for name, price in models.items():
        lines += ["", f'[models."{name}"]', f"input = {price.input:.6g}", f"output = {price.output:.6g}"]
    return "\n".join(lines) + "\n"


def render(suggested: SuggestedPrices, listed: ModelPrice) -> str:
    """What a person reads: the suggestion against the list, and the utilization at which each tier's list price
    breaks even (over 100%: never)."""
    s = suggested
    lines = [
        f"{s.model.model}: machine cost at full load, per 1M tokens: input ${s.cost.input:.4f}, output ${s.cost.output:.4f}",
        (
            f"suggested at utilization {s.utilization:g}, margin {s.margin:g}: input ${s.price.input:.4f}, "
            f"output ${s.price.output:.4f} (listed: ${listed.input:.4f}, ${listed.output:.4f})"
        ),
        "",
        f"{'tier':<9}{'x':>6}  list breaks even at (input / output utilization)",
    ]
    for t in s.tiers:
        flag = "   below cost at the target" if s.below_cost(t) else ""
        shares = [f"{u:.0%}" if math.isfinite(u) else "never" for u in (t.input_utilization, t.output_utilization)]
        lines.append(f"{t.tier:<9}{t.multiplier:>6g}  {shares[0]:>8} / {shares[1]}{flag}")
    return "\n".join(lines) + "\n"


def below_cost(model: str, prices: PriceSheet, hourly_price: float, decode_tokens_per_second: float) -> list[str]:
    """What `carpool serve --hourly-price` warns of at start: each tier whose list output price is below what an
    output token costs the machine even at full load, at the warm-up's best decode rate (cold steps only make the
    rate lower, and a machine busy part of the hour costs more a token: a tier listed here never covers it)."""
    cost = machine_cost_per_1m(hourly_price, decode_tokens_per_second)
    listed = prices.price(model).output
    return [
        f"{model}: the list output price of tier {tier}, ${listed * prices.tier_multiplier(tier):.4f} per 1M tokens, is"
        f" below the machine's cost at full load, at least ${cost:.4f} ({decode_tokens_per_second:,.0f} tokens/s, the"
        f" warm-up's best decode step, at ${hourly_price:g}/hour): `carpool cost prices` writes a sheet that covers it"
        for tier in TIER_NAMES
        if listed * prices.tier_multiplier(tier) < cost
    ]
