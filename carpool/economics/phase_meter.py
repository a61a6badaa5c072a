"""Where the engine's busy time goes: prefill or decode. The measured side of the self-hosting cost model.

The server registers a PhaseMeter as an engine step listener and exports its totals in /metrics;
`carpool cost model` reads them back (or the same totals from a `carpool bench` JSON). A step that mixes
prefill chunks with decodes is split by token count: with a prompt chunk in the batch the step is
compute-bound, and every token in it costs about the same. Steps that only decode are also kept apart:
their time per step is what the bandwidth and compute floors are compared with.
"""

import threading
from dataclasses import asdict, dataclass, fields, replace

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily
from prometheus_client.parser import text_string_to_metric_families

from carpool.engine.llm_engine import StepStats
from carpool.engine.outputs import RequestOutput


@dataclass
class PhaseTotals:
    prefill_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_tokens: int = 0
    decode_seconds: float = 0.0
    decode_steps: int = 0  # steps that only decoded
    decode_step_seconds: float = 0.0  # ... their time
    decode_step_sequences: int = 0  # ... the sequences in them (one token each)
    decode_step_context_tokens: int = 0  # ... those sequences' context lengths, summed

    def as_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, values: dict) -> "PhaseTotals":
        missing = [f.name for f in fields(cls) if f.name not in values]
        if missing:
            raise ValueError(f"phase totals lack {', '.join(missing)}")
        return cls(**{f.name: f.type(values[f.name]) for f in fields(cls)})  # f.type is int or float


# Prometheus counters: (family, phase label or None, PhaseTotals field). Samples carry the family name + "_total".
METRICS = (
    ("carpool:engine_phase_tokens", "prefill", "prefill_tokens"),
    ("carpool:engine_phase_tokens", "decode", "decode_tokens"),
    ("carpool:engine_phase_seconds", "prefill", "prefill_seconds"),
    ("carpool:engine_phase_seconds", "decode", "decode_seconds"),
    ("carpool:decode_steps", None, "decode_steps"),
    ("carpool:decode_step_seconds", None, "decode_step_seconds"),
    ("carpool:decode_step_sequences", None, "decode_step_sequences"),
    ("carpool:decode_step_context_tokens", None, "decode_step_context_tokens"),
)
_HELP = {
    "carpool:engine_phase_tokens": "Tokens the engine computed, by phase",
    "carpool:engine_phase_seconds": "Engine busy seconds, by phase (mixed steps split by token count)",
    "carpool:decode_steps": "Engine steps that only decoded",
    "carpool:decode_step_seconds": "Seconds spent in steps that only decoded",
    "carpool:decode_step_sequences": "Sequences decoded in steps that only decoded",
    "carpool:decode_step_context_tokens": "Context tokens of the sequences decoded in steps that only decoded",
}


class PhaseMeter:
    def __init__(self):
        self._lock = threading.Lock()
        self._totals = PhaseTotals()

    def __call__(self, stats: StepStats | None, outputs: list[RequestOutput]) -> None:
        """The engine's step listener (stats is None for an abort, which computes nothing)."""
        if stats is None or stats.num_tokens == 0:
            return
        with self._lock:
            t = self._totals
            prefill_share = stats.num_prefill_tokens / stats.num_tokens
            t.prefill_tokens += stats.num_prefill_tokens
            t.prefill_seconds += stats.duration * prefill_share
            t.decode_tokens += stats.num_decode_tokens
            t.decode_seconds += stats.duration * (1 - prefill_share)
            if stats.num_prefill_tokens == 0:
                t.decode_steps += 1
                t.decode_step_seconds += stats.duration
                t.decode_step_sequences += stats.num_decode_tokens
                t.decode_step_context_tokens += sum(len(o.prompt_token_ids) + len(o.token_ids) for o in outputs)

    def totals(self) -> PhaseTotals:
        with self._lock:
            return replace(self._totals)

    def register_metrics(self, registry: CollectorRegistry) -> None:
        registry.register(self)

    def collect(self):
        """The prometheus_client collector interface: read the totals at scrape time."""
        totals = self.totals()
        families: dict[str, CounterMetricFamily] = {}
        for family, phase, field in METRICS:
            if family not in families:
                families[family] = CounterMetricFamily(family, _HELP[family], labels=["phase"] if phase else None)
            families[family].add_metric([phase] if phase else [], getattr(totals, field))
        yield from families.values()


def totals_from_metrics_text(text: str) -> PhaseTotals:
    """The totals a server exported in /metrics (Prometheus text format)."""
    values = {}
    wanted = {(family + "_total", phase): field for family, phase, field in METRICS}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            field = wanted.get((sample.name, sample.labels.get("phase")))
            if field is not None:
                values[field] = sample.value
    try:
        return PhaseTotals.from_dict(values)
    except ValueError as error:
        raise ValueError(f"metrics: {error}; is the server's PhaseMeter registered in its /metrics?") from None
