"""The pins' series on /metrics and /dashboard, from an engine snapshot: blocks and bytes by TTL, and counters that
follow the engine's (pinned prefixes lapsed, pins refused for the bound, requests that read a pinned prefix)."""

from collections import Counter

from prometheus_client import generate_latest

from carpool.engine.async_engine import EngineSnapshot
from carpool.engine.block_manager import PinStats
from carpool.server.dashboard.data import pins, read_samples
from carpool.server.metrics import ServerMetrics, ttl_label


def snapshot(stats: PinStats) -> EngineSnapshot:
    return EngineSnapshot(1, 0, 0.5, 10, 64, 16, 20, pins=stats, kv_block_bytes=1000)


def test_pins_on_metrics_and_dashboard():
    metrics = ServerMetrics(["m"])
    first = PinStats(Counter({3600.0: 8, 300.0: 4}), Counter({300.0: 4}), expiries=1, refused=2, hits=3, hit_tokens=48)
    metrics.render({"m": snapshot(first)})
    later = PinStats(Counter({3600.0: 8, 300.0: 0}), Counter({300.0: 8}), expiries=2, refused=2, hits=5, hit_tokens=80)
    text = metrics.render({"m": snapshot(later)}).decode()
    for line in (
        'carpool:cache_pinned_blocks{model_name="m",ttl="1h"} 8.0',
        'carpool:cache_pinned_blocks{model_name="m",ttl="5m"} 0.0',
        'carpool:cache_pinned_bytes{model_name="m",ttl="1h"} 8000.0',
        'carpool:cache_pin_expired_blocks_total{model_name="m",ttl="5m"} 8.0',
        'carpool:cache_pin_expiries_total{model_name="m"} 2.0',
        'carpool:cache_pin_refused_total{model_name="m"} 2.0',
        'carpool:cache_pin_hits_total{model_name="m"} 5.0',
        'carpool:cache_pin_hit_tokens_total{model_name="m"} 80.0',
    ):
        assert line in text, line
    assert text == generate_latest(metrics.registry).decode()
    assert pins(read_samples(metrics.registry), "m") == {
        "blocks": {"1h": 8.0, "5m": 0.0},
        "bytes": 8000.0,
        "expiries": 2.0,
        "refused": 2.0,
        "hits": 5.0,
    }


def test_ttl_labels_as_anthropic_names_them():
    assert [ttl_label(s) for s in (300.0, 3600.0, 90.0, 7200.0, 2.5)] == ["5m", "1h", "90s", "2h", "2.5s"]
