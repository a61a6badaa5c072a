"""The price sheet (a TOML file) and the one formula that turns a request's token counts into dollars.

A sheet that cannot price a request must stop the server before it serves one, so loading checks every entry
and names the one at fault; after that, pricing a request cannot fail for a model the sheet covers.
"""

import math
import tomllib
from dataclasses import dataclass
from pathlib import Path

from carpool.economics.contract import UsageRecord
from carpool.engine.tiers import TIER_NAMES, TIERS

SHIPPED_PRICES = Path(__file__).with_name("prices.toml")
ANY_MODEL = "*"  # the entry that prices models without one of their own
TOKENS_PER_PRICE_UNIT = 1_000_000  # prices are per 1M tokens

_CACHE_FIELDS = ("read", "write")
# [cache] entries a sheet may leave out (sheets from before prompt-cache TTLs), with their defaults: Anthropic's
# 1-hour write multiplier, and its minimum cacheable prefix for most models.
_CACHE_DEFAULTS = {"write_1h": 2.0, "min_tokens": 1024}
_MODEL_FIELDS = ("input", "output")


class PriceSheetError(ValueError):
    """The sheet is malformed or incomplete; the message names the file and the entry."""


@dataclass(frozen=True)
class ModelPrice:
    input: float  # dollars per 1M prompt tokens computed fresh
    output: float  # dollars per 1M output tokens


@dataclass(frozen=True)
class PriceSheet:
    models: dict[str, ModelPrice]
    cache_read: float  # multiplier on the input price for prompt tokens read from the prefix cache
    cache_write: float  # multiplier on the input price for prompt tokens that create new cache entries (and 5m pins)
    tiers: dict[str, float]  # multiplier on a request's whole cost
    source: str
    cache_write_1h: float = _CACHE_DEFAULTS["write_1h"]  # the same for tokens written under a 1-hour TTL pin
    cache_min_tokens: int = _CACHE_DEFAULTS["min_tokens"]  # shorter breakpoint prefixes are not pinned

    def covers(self, model: str) -> bool:
        return model in self.models or ANY_MODEL in self.models

    def price(self, model: str) -> ModelPrice:
        if model in self.models:
            return self.models[model]
        if ANY_MODEL in self.models:
            return self.models[ANY_MODEL]
        raise PriceSheetError(f'price sheet {self.source}: no entry models.{_quote(model)} and no models."*"')

    def tier_multiplier(self, tier: str) -> float:
        if tier not in self.tiers:
            raise ValueError(f"unknown service tier {tier!r} (known: {', '.join(TIER_NAMES)})")
        return self.tiers[tier]

    def worst_case_cost(self, tier: str, tokens: int, models: tuple[str, ...] = ()) -> float:
        """The most `tokens` (prompt and output together) can cost at `tier` on any of `models` (default: any
        model on the sheet): each at the dearest rate charged (a cache write, if that costs more than an input)."""
        prices = [self.price(model) for model in models] or list(self.models.values())
        dearest = max(max(p.input * max(1.0, self.cache_write, self.cache_write_1h), p.output) for p in prices)
        return tokens * dearest / TOKENS_PER_PRICE_UNIT * self.tier_multiplier(tier)

    def cost(self, usage: UsageRecord) -> float:
        """Dollars for one request. Cache-write tokens are part of the uncached prompt tokens, billed at the
        write rate instead of the plain input rate: automatic and 5-minute TTL writes at `write`, 1-hour ones at
        `write_1h`; the tier's multiplier applies on top. An aborted request is billed for the tokens it got."""
        price = self.price(usage.model)
        writes = usage.cache_write_tokens + usage.cache_write_5m_tokens
        fresh = usage.uncached_prompt_tokens - writes - usage.cache_write_1h_tokens
        per_price_unit = (
            fresh * price.input
            + writes * price.input * self.cache_write
            + usage.cache_write_1h_tokens * price.input * self.cache_write_1h
            + usage.cached_tokens * price.input * self.cache_read
            + usage.output_tokens * price.output
        )
        return per_price_unit / TOKENS_PER_PRICE_UNIT * self.tier_multiplier(usage.tier)


def load_price_sheet(path: str | Path | None = None) -> PriceSheet:
    """The sheet at `path`, or the shipped one; raises PriceSheetError naming the first bad entry."""
    path = Path(path) if path is not None else SHIPPED_PRICES
    where = f"price sheet {path}"
    try:
        raw = tomllib.loads(path.read_text())
    except OSError as error:
        raise PriceSheetError(f"{where}: cannot read: {error.strerror or error}") from error
    except tomllib.TOMLDecodeError as error:
        raise PriceSheetError(f"{where}: not valid TOML: {error}") from error
    _only_known(raw, ("cache", "tiers", "models"), where, "")
    cache = _cache_table(raw, where)
    models_table = raw.get("models")
    if not isinstance(models_table, dict) or not models_table:
        raise PriceSheetError(f'{where}: [models] is missing or empty: add [models."NAME"] with input and output')
    models = {}
    for name, entry in models_table.items():
        label = f"models.{_quote(name)}"
        if not isinstance(entry, dict):
            raise PriceSheetError(f"{where}: {label} must be a table with input and output")
        _only_known(entry, _MODEL_FIELDS, where, f"{label}.")
        models[name] = ModelPrice(
            **{field: _number(entry, field, f"{label}.{field}", where) for field in _MODEL_FIELDS}
        )
    return PriceSheet(
        models=models,
        cache_read=cache["read"],
        cache_write=cache["write"],
        cache_write_1h=cache["write_1h"],
        cache_min_tokens=cache["min_tokens"],
        tiers=_tier_multipliers(raw, where),
        source=str(path),
    )


def _cache_table(raw: dict, where: str) -> dict:
    table = raw.get("cache")
    if not isinstance(table, dict):
        raise PriceSheetError(f"{where}: [cache] is missing (needs {', '.join(_CACHE_FIELDS)})")
    _only_known(table, (*_CACHE_FIELDS, *_CACHE_DEFAULTS), where, "cache.")
    entries = {field: _number(table, field, f"cache.{field}", where) for field in _CACHE_FIELDS}
    entries["write_1h"] = (
        _number(table, "write_1h", "cache.write_1h", where) if "write_1h" in table else _CACHE_DEFAULTS["write_1h"]
    )
    min_tokens = table.get("min_tokens", _CACHE_DEFAULTS["min_tokens"])
    if isinstance(min_tokens, bool) or not isinstance(min_tokens, int) or min_tokens < 0:
        raise PriceSheetError(f"{where}: cache.min_tokens must be a non-negative integer, got {min_tokens!r}")
    entries["min_tokens"] = min_tokens
    return entries


def _tier_multipliers(raw: dict, where: str) -> dict[str, float]:
    """[tiers] may set any tier's multiplier; a tier it leaves out costs its default (carpool.engine.tiers)."""
    table = raw.get("tiers", {})
    if not isinstance(table, dict):
        raise PriceSheetError(f"{where}: [tiers] must be a table of multipliers ({', '.join(TIER_NAMES)})")
    _only_known(table, TIER_NAMES, where, "tiers.")
    return {
        tier.name: _number(table, tier.name, f"tiers.{tier.name}", where)
        if tier.name in table
        else tier.price_multiplier
        for tier in TIERS
    }


def _number(table: dict, field: str, label: str, where: str) -> float:
    if field not in table:
        raise PriceSheetError(f"{where}: {label} is missing")
    value = table[field]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise PriceSheetError(f"{where}: {label} must be a number, got {value!r}")
    if value < 0:
        raise PriceSheetError(f"{where}: {label} must not be negative, got {value!r}")
    return float(value)


def _only_known(table: dict, known: tuple[str, ...], where: str, prefix: str) -> None:
    """A misspelt field would otherwise be ignored and its price silently missing."""
    unknown = sorted(set(table) - set(known))
    if unknown:
        raise PriceSheetError(f"{where}: unknown entry {prefix}{unknown[0]} (expected one of: {', '.join(known)})")


def _quote(name: str) -> str:
    return f'"{name}"'
