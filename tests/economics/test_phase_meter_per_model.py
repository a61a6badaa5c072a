"""Phase totals of a server with several models: one collector exports each model's meter under `model_name`,
and the cost model reads back the one it is asked for."""

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from carpool.economics.phase_meter import PhaseMeter, register_phase_metrics, totals_from_metrics_text
from carpool.engine.llm_engine import StepStats


def metered(prefill_tokens: int, decode_tokens: int) -> PhaseMeter:
    meter = PhaseMeter()
    meter(StepStats(prefill_tokens + decode_tokens, 1, prefill_tokens, decode_tokens, 0, duration=0.5), [])
    return meter


def test_each_models_totals_read_back_by_name():
    meters = {"small": metered(100, 0), "large": metered(0, 7)}
    registry = CollectorRegistry()
    register_phase_metrics(registry, meters)
    text = generate_latest(registry).decode()
    assert text.count("# TYPE carpool:engine_phase_tokens") == 1  # one family, a series per model
    for name, meter in meters.items():
        assert totals_from_metrics_text(text, name).as_dict() == pytest.approx(meter.totals().as_dict())
    with pytest.raises(ValueError, match="several models \\('small', 'large'\\)"):
        totals_from_metrics_text(text)
    with pytest.raises(ValueError, match="'medium'"):
        totals_from_metrics_text(text, "medium")


def test_a_single_model_server_needs_no_name():
    meter = metered(10, 2)
    registry = CollectorRegistry()
    register_phase_metrics(registry, {"only": meter})
    assert totals_from_metrics_text(generate_latest(registry).decode()) == meter.totals()
