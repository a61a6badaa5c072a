"""The self-hosting cost model: what a token costs when you rent the machine by the hour.

A machine billed per hour costs the same busy or idle, so a token's cost is the machine time it takes. The
engine's measured busy time per phase, divided by the tokens of that phase, gives dollars per 1M input tokens
(prefill) and per 1M output tokens (decode), at full load. Tier prices scale that by the sheet's multipliers.

Beside it, the decode step time is set against its two floors: the bytes a step must read (every weight once,
plus each sequence's KV cache) over the measured memory bandwidth, and the FLOPs it must do over the measured
FLOP/s. The larger floor names what bounds decode, and the gap to the measured time is what is left to win.
"""

import json
from dataclasses import asdict, dataclass

from carpool.economics.footprint import ModelFootprint
from carpool.economics.hardware import Hardware
from carpool.economics.phase_meter import PhaseTotals
from carpool.economics.prices import TOKENS_PER_PRICE_UNIT, PriceSheet
from carpool.engine.tiers import TIER_NAMES

SECONDS_PER_HOUR = 3600


@dataclass(frozen=True)
class TierCost:
    tier: str
    input_per_1m: float  # self-hosted dollars per 1M input tokens, tier multiplier applied
    output_per_1m: float
    list_input_per_1m: float  # the price sheet's, for comparison
    list_output_per_1m: float


@dataclass(frozen=True)
class DecodeFloors:
    step_seconds: float  # measured, mean over steps that only decoded
    batch_size: float  # sequences per such step
    context_tokens: float  # mean context length of those sequences
    bytes_per_step: float
    flops_per_step: float
    bandwidth_floor_seconds: float
    compute_floor_seconds: float

    @property
    def bound(self) -> str:
        return "memory bandwidth" if self.bandwidth_floor_seconds >= self.compute_floor_seconds else "compute"

    @property
    def efficiency(self) -> float:
        """The larger floor over the measured step time: 1.0 would be a step at the hardware's limit."""
        return max(self.bandwidth_floor_seconds, self.compute_floor_seconds) / self.step_seconds


@dataclass(frozen=True)
class CostModel:
    model: str
    hourly_price: float
    hardware: Hardware
    prefill_tokens_per_second: float
    decode_tokens_per_second: float
    tiers: list[TierCost]
    decode: DecodeFloors

    def as_dict(self) -> dict:
        return asdict(self) | {
            "decode": asdict(self.decode) | {"bound": self.decode.bound, "efficiency": self.decode.efficiency}
        }


def machine_cost_per_1m(hourly_price: float, tokens_per_second: float) -> float:
    """Dollars per 1M tokens for a machine at `hourly_price` that is busy the whole hour at that rate."""
    return hourly_price / SECONDS_PER_HOUR * TOKENS_PER_PRICE_UNIT / tokens_per_second


def cost_model(
    phases: PhaseTotals, hourly_price: float, hardware: Hardware, footprint: ModelFootprint, prices: PriceSheet
) -> CostModel:
    if hourly_price <= 0:
        raise ValueError(f"hourly price must be positive, got {hourly_price}")
    if phases.prefill_tokens == 0 or phases.decode_tokens == 0 or phases.decode_steps == 0:
        raise ValueError("the measurements hold no prefill or no decode: run load through the server first")
    prefill_rate = phases.prefill_tokens / phases.prefill_seconds
    decode_rate = phases.decode_tokens / phases.decode_seconds
    base_input = machine_cost_per_1m(hourly_price, prefill_rate)
    base_output = machine_cost_per_1m(hourly_price, decode_rate)
    listed = prices.price(footprint.name)
    tiers = []
    for tier in TIER_NAMES:
        m = prices.tier_multiplier(tier)
        tiers.append(TierCost(tier, base_input * m, base_output * m, listed.input * m, listed.output * m))
    return CostModel(
        model=footprint.name,
        hourly_price=hourly_price,
        hardware=hardware,
        prefill_tokens_per_second=prefill_rate,
        decode_tokens_per_second=decode_rate,
        tiers=tiers,
        decode=decode_floors(phases, hardware, footprint),
    )


def decode_floors(phases: PhaseTotals, hardware: Hardware, footprint: ModelFootprint) -> DecodeFloors:
    batch = phases.decode_step_sequences / phases.decode_steps
    context = phases.decode_step_context_tokens / phases.decode_step_sequences
    # Weights are read once per step whatever the batch; each sequence reads its own KV cache.
    step_bytes = footprint.streamed_bytes_per_step + batch * context * footprint.kv_bytes_per_token
    step_flops = batch * (footprint.matmul_flops_per_token() + context * footprint.attention_flops_per_context_token)
    return DecodeFloors(
        step_seconds=phases.decode_step_seconds / phases.decode_steps,
        batch_size=batch,
        context_tokens=context,
        bytes_per_step=step_bytes,
        flops_per_step=step_flops,
        bandwidth_floor_seconds=step_bytes / hardware.memory_bandwidth,
        compute_floor_seconds=step_flops / hardware.flops,
    )


def render(model: CostModel, fmt: str) -> str:
    if fmt == "json":
        return json.dumps(model.as_dict(), indent=2)
    if fmt != "table":
        raise ValueError(f"format must be table or json, got {fmt!r}")
    d, hw = model.decode, model.hardware
    prefill_rate, decode_rate = model.prefill_tokens_per_second, model.decode_tokens_per_second
    lines = [
        f"model {model.model} on {hw.device} at ${model.hourly_price:.2f}/hour",
        f"measured: prefill {prefill_rate:,.0f} tokens/s, decode {decode_rate:,.1f} tokens/s (busy time)",
        "",
        f"{'tier':<9}" + "".join(f"{h:>12}" for h in ("in $/1M", "out $/1M", "list in", "list out")),
    ]
    for t in model.tiers:
        prices = (t.input_per_1m, t.output_per_1m, t.list_input_per_1m, t.list_output_per_1m)
        lines.append(f"{t.tier:<9}" + "".join(f"{p:>12.4f}" for p in prices))
    lines += [
        "",
        (
            f"decode step: {d.step_seconds * 1e3:.2f} ms measured,"
            f" {d.batch_size:.1f} sequences at {d.context_tokens:.0f} tokens of context"
        ),
        (
            f"  bandwidth floor {d.bandwidth_floor_seconds * 1e3:.2f} ms"
            f" = {d.bytes_per_step / 1e6:,.1f} MB / {hw.memory_bandwidth / 1e9:,.1f} GB/s"
        ),
        (
            f"  compute floor   {d.compute_floor_seconds * 1e3:.2f} ms"
            f" = {d.flops_per_step / 1e9:,.2f} GFLOP / {hw.flops / 1e9:,.1f} GFLOP/s"
        ),
        f"  bound by {d.bound}: the measured step takes {1 / d.efficiency:.1f}x its floor",
    ]
    return "\n".join(lines) + "\n"
