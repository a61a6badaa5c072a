"""The numbers behind /dashboard, read from the registry /metrics renders, so the two always agree.

Totals are the counters as /metrics shows them. Rates, quantiles and distributions cover a recent window: the
difference between now and the newest reading at least WINDOW_SECONDS old, as Prometheus' `rate()` and
`histogram_quantile()` over a range would. Until there is one, the oldest reading at least MIN_WINDOW_SECONDS old
(a page just opened), and before that the server's start, with every counter at zero.
"""

import math
import threading
import time
from collections import deque

from prometheus_client import CollectorRegistry

from carpool.engine.tiers import TIER_NAMES

WINDOW_SECONDS = 30.0
MIN_WINDOW_SECONDS = 4.0  # two refreshes of the page
HISTORY_SECONDS = 4 * WINDOW_SECONDS
QUANTILES = {"p50": 0.5, "p99": 0.99}

Samples = dict[tuple[str, frozenset], float]


def read_samples(registry: CollectorRegistry) -> Samples:
    """Every sample in the registry, keyed by (name, labels), as /metrics would print them."""
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in registry.collect()
        for sample in family.samples
        if not sample.name.endswith("_created")
    }


def total(samples: Samples, name: str, **match: str) -> float:
    """The sum of a sample over every label set that has the `match` labels."""
    wanted = set(match.items())
    return sum(value for (sample, labels), value in samples.items() if sample == name and wanted <= labels)


def buckets(samples: Samples, family: str, **match: str) -> list[tuple[float, float]]:
    """A histogram's cumulative buckets [(upper bound, count)], summed over the label sets that match."""
    sums: dict[float, float] = {}
    wanted = set(match.items())
    for (sample, labels), value in samples.items():
        if sample == f"{family}_bucket" and wanted <= labels:
            bound = float(dict(labels)["le"])
            sums[bound] = sums.get(bound, 0.0) + value
    return sorted(sums.items())


def pins(samples: Samples, model: str) -> dict:
    """Cache breakpoints' TTL pins: blocks and bytes pinned now by TTL, and since start the pinned prefixes that
    lapsed, the pins the bound refused and the requests that read a pinned prefix."""
    ttls = sorted({dict(labels)["ttl"] for name, labels in samples if name == "carpool:cache_pinned_blocks"})
    return {
        "blocks": {ttl: total(samples, "carpool:cache_pinned_blocks", model_name=model, ttl=ttl) for ttl in ttls},
        "bytes": total(samples, "carpool:cache_pinned_bytes", model_name=model),
        "expiries": total(samples, "carpool:cache_pin_expiries_total", model_name=model),
        "refused": total(samples, "carpool:cache_pin_refused_total", model_name=model),
        "hits": total(samples, "carpool:cache_pin_hits_total", model_name=model),
    }


def quantile(q: float, cumulative: list[tuple[float, float]]) -> float | None:
    """Prometheus' histogram_quantile: linear within the bucket that holds the q-th observation; the largest
    finite bound when that bucket is +Inf's; None without observations."""
    if not cumulative or cumulative[-1][1] <= 0:
        return None
    rank = q * cumulative[-1][1]
    lower_bound, lower_count = 0.0, 0.0
    for bound, count in cumulative:
        if count >= rank:
            if math.isinf(bound):
                return lower_bound
            if count == lower_count:
                return bound
            return lower_bound + (bound - lower_bound) * (rank - lower_count) / (count - lower_count)
        lower_bound, lower_count = bound, count
    return lower_bound


def minus(now: list[tuple[float, float]], before: list[tuple[float, float]]) -> list[tuple[float, float]]:
    earlier = dict(before)
    return [(bound, count - earlier.get(bound, 0.0)) for bound, count in now]


def per_bucket(cumulative: list[tuple[float, float]]) -> list[dict]:
    """Cumulative counts as the count in each bucket: the distribution a bar chart draws."""
    out, previous = [], 0.0
    for bound, count in cumulative:
        out.append({"le": "+Inf" if math.isinf(bound) else bound, "count": count - previous})
        previous = count
    return out


def ratio(numerator: float, denominator: float) -> float | None:
    return numerator / denominator if denominator else None


def step_budget_reason(samples: Samples, model_name: str) -> str | None:
    """The SLO controller's latest reason ("itl priority", "throughput", "fixed"), None before the first step."""
    for (sample, labels), value in samples.items():
        labels = dict(labels)
        if sample == "carpool:step_budget_reason" and labels["model_name"] == model_name and value == 1:
            return f"{labels['reason']} {labels['tier']}".strip()
    return None


class DashboardData:
    """Builds the document /dashboard/data serves; remembers recent readings for the windowed figures."""

    def __init__(self, registry: CollectorRegistry, model_names: list[str], started: float):
        self.registry, self.model_names, self.started = registry, model_names, started
        self._history: deque[tuple[float, Samples]] = deque()
        self._lock = threading.Lock()

    def document(self) -> dict:
        now = time.time()
        samples = read_samples(self.registry)
        since, before = self._remember(now, samples)
        seconds = max(now - since, 1e-9)
        return {
            "time": now,
            "window_seconds": seconds,
            "models": [self._model(name, samples, before, seconds) for name in self.model_names],
            "tiers": self._tiers(samples),
        }

    def _remember(self, now: float, samples: Samples) -> tuple[float, Samples]:
        """(time, samples) of the window's start, and keep this reading (at most one a second)."""
        with self._lock:
            while self._history and now - self._history[0][0] > HISTORY_SECONDS:
                self._history.popleft()
            baseline = (self.started, {})
            old_enough = [(at, old) for at, old in self._history if now - at >= MIN_WINDOW_SECONDS]
            if old_enough:
                full = [(at, old) for at, old in old_enough if now - at >= WINDOW_SECONDS]
                baseline = full[-1] if full else old_enough[0]
            if not self._history or now - self._history[-1][0] >= 1.0:
                self._history.append((now, samples))
            return baseline

    def _model(self, name: str, samples: Samples, before: Samples, seconds: float) -> dict:
        def delta(sample: str, **match: str) -> float:
            return total(samples, sample, model_name=name, **match) - total(before, sample, model_name=name, **match)

        def window_histogram(family: str, **match: str) -> list[tuple[float, float]]:
            return minus(
                buckets(samples, family, model_name=name, **match), buckets(before, family, model_name=name, **match)
            )

        def latency(family: str, **match: str) -> dict:
            recent = window_histogram(family, **match)
            figures = {label: quantile(q, recent) for label, q in QUANTILES.items()}
            return figures | {"count": recent[-1][1] if recent else 0.0}

        prefill, decode = (delta("carpool:engine_phase_seconds_total", phase=phase) for phase in ("prefill", "decode"))
        return {
            "name": name,
            "totals": {
                "requests": total(samples, "carpool:request_success_total", model_name=name),
                "prompt_tokens": total(samples, "carpool:prompt_tokens_total", model_name=name),
                "generation_tokens": total(samples, "carpool:generation_tokens_total", model_name=name),
                "preemptions": total(samples, "carpool:num_preemptions_total", model_name=name),
            },
            "gauges": {
                "kv_cache_usage": total(samples, "carpool:kv_cache_usage_perc", model_name=name),
                "running": total(samples, "carpool:num_requests_running", model_name=name),
                "waiting": total(samples, "carpool:num_requests_waiting", model_name=name),
                "prefix_cache_hit_rate": total(samples, "carpool:prefix_cache_hit_rate", model_name=name),
                "step_token_budget": total(samples, "carpool:step_token_budget", model_name=name),
                "step_max_seqs": total(samples, "carpool:step_max_seqs", model_name=name),
            },
            "step_budget_reason": step_budget_reason(samples, name),
            "pins": pins(samples, name),
            "queued": {
                tier: total(samples, "carpool:num_requests_queued", model_name=name, tier=tier) for tier in TIER_NAMES
            },
            "window": {
                "output_tokens_per_second": delta("carpool:generation_tokens_total") / seconds,
                "prompt_tokens_per_second": delta("carpool:prompt_tokens_total") / seconds,
                "requests_per_second": delta("carpool:request_success_total") / seconds,
                "ttft": {tier: latency("carpool:time_to_first_token_seconds", tier=tier) for tier in TIER_NAMES},
                "itl": {tier: latency("carpool:inter_token_latency_by_tier_seconds", tier=tier) for tier in TIER_NAMES},
                "prefill_share": ratio(prefill, prefill + decode),
                "busy_share": (prefill + decode) / seconds,
                "prefix_cache_hit_rate": ratio(
                    delta("carpool:prefix_cache_hits_total"), delta("carpool:prefix_cache_queries_total")
                ),
                "step_tokens": per_bucket(window_histogram("carpool:iteration_tokens")),
                "step_seqs": per_bucket(window_histogram("carpool:iteration_seqs")),
            },
        }

    def _tiers(self, samples: Samples) -> dict:
        """Tokens and cost per tier over every model since start; cost only where a ledger prices requests."""
        priced = any(name == "carpool:cost_total" for name, _ in samples)
        tiers = {}
        for tier in TIER_NAMES:
            tokens = total(samples, "carpool:prompt_tokens_total", tier=tier) + total(
                samples, "carpool:generation_tokens_total", tier=tier
            )
            cost = total(samples, "carpool:cost_total", tier=tier) if priced else None
            tiers[tier] = {
                "tokens": tokens,
                "cost": cost,
                "cost_per_1k_tokens": ratio(cost * 1000, tokens) if priced else None,
            }
        return tiers
