"""Where the engine's busy time goes: prefill or decode. The measured side of the self-hosting cost model.

The server registers a PhaseMeter per served model as that engine's step listener and exports their totals in
/metrics, labelled `model_name`; `carpool cost model` reads one model's back (or the same totals from a
`carpool bench` JSON). A step that mixes
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
        """Export these totals in `registry`, unlabelled (one engine, no server)."""
        registry.register(_PhaseCollector({(): self}, []))


def register_phase_metrics(registry: CollectorRegistry, meters: dict[str, PhaseMeter]) -> None:
    """Export each served model's totals in `registry`, its series labelled `model_name`. One collector for all:
    a second collector of the same families would repeat them in the exposition."""
    registry.register(_PhaseCollector({(name,): meter for name, meter in meters.items()}, ["model_name"]))


class _PhaseCollector:
    def __init__(self, meters: dict[tuple[str, ...], PhaseMeter], label_names: list[str]):
        self.meters, self.label_names = meters, label_names

    def collect(self):
        """The prometheus_client collector interface: read the totals at scrape time."""
        families: dict[str, CounterMetricFamily] = {}
        for label_values, meter in self.meters.items():
            totals = meter.totals()
            for family, phase, field in METRICS:
                if family not in families:
                    labels = self.label_names + (["phase"] if phase else [])
                    families[family] = CounterMetricFamily(family, _HELP[family], labels=labels)
                values = list(label_values) + ([phase] if phase else [])
                families[family].add_metric(values, getattr(totals, field))
        yield from families.values()


def totals_from_metrics_text(text: str, model_name: str | None = None) -> PhaseTotals:
    """The totals a server exported in /metrics (Prometheus text format): those of `model_name`, which may be
    left out when the server serves one model."""
    by_model: dict[str | None, dict] = {}
    wanted = {(family + "_total", phase): field for family, phase, field in METRICS}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            field = wanted.get((sample.name, sample.labels.get("phase")))
            if field is not None:
                by_model.setdefault(sample.labels.get("model_name"), {})[field] = sample.value
    served = ", ".join(repr(name) for name in by_model if name is not None)
    if model_name is None and len(by_model) > 1:
        raise ValueError(f"metrics: the server serves several models ({served}): name the one to read")
    if model_name is not None and model_name not in by_model:
        raise ValueError(f"metrics: no phase totals for the model {model_name!r} (the server has: {served or 'none'})")
    values = by_model.get(model_name, {}) if model_name is not None else next(iter(by_model.values()), {})
    try:
        return PhaseTotals.from_dict(values)
    except ValueError as error:
        raise ValueError(f"metrics: {error}; is the server's PhaseMeter registered in its /metrics?") from None
