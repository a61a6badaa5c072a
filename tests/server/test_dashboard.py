"""/dashboard in process: who may read its data, that its numbers are /metrics' numbers, and the quantile math."""

import math

import pytest
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.parser import text_string_to_metric_families

import carpool.server.dashboard.data as data_module
from carpool.economics.dashboard import ledger_panels
from carpool.economics.db import connect
from carpool.economics.keys import ADMIN_SCOPES, create_key
from carpool.economics.ledger_gate import LedgerGate
from carpool.economics.prices import load_price_sheet
from carpool.engine.async_engine import AsyncEngine
from carpool.server.app import create_app
from carpool.server.dashboard.data import DashboardData, buckets, quantile, read_samples
from carpool.server.open_gate import OpenGate


def bearer(secret: str | None) -> dict:
    return {"Authorization": f"Bearer {secret}"} if secret else {}


@pytest.fixture
def ledger_server(llm, tmp_path):
    """An app on a ledger with an admin key and a tenant key with a daily budget."""
    conn = connect(tmp_path / "carpool.db")
    _, admin = create_key(conn, "ops", scopes=ADMIN_SCOPES)
    tenant_key, tenant = create_key(conn, "acme", budget=2.0, budget_period="day")
    conn.close()
    gate = LedgerGate(tmp_path / "carpool.db", load_price_sheet(None))
    app = create_app(
        AsyncEngine(engine=llm.engine),
        gate,
        "tiny",
        batch_dir=str(tmp_path / "batches"),
        ledger_panels=ledger_panels(gate),
    )
    with TestClient(app) as http:
        yield http, admin, tenant, tenant_key
    gate.close()


def test_with_a_ledger_only_an_admin_key_reads_the_data_but_the_page_is_open(ledger_server):
    http, admin, tenant, _ = ledger_server
    assert http.get("/dashboard").status_code == 200
    assert http.get("/dashboard/dashboard.js").status_code == 200
    assert http.get("/dashboard/data").status_code == 401
    refused = http.get("/dashboard/data", headers=bearer(tenant))
    assert (refused.status_code, refused.json()["error"]["code"]) == (403, "admin_key_required")
    assert http.get("/dashboard/data", headers=bearer(admin)).status_code == 200


def test_a_ledger_gate_makes_the_data_admin_only_even_without_the_ledger_panels(llm, tmp_path):
    conn = connect(tmp_path / "carpool.db")
    _, tenant = create_key(conn, "acme")
    conn.close()
    gate = LedgerGate(tmp_path / "carpool.db", load_price_sheet(None))
    with TestClient(create_app(AsyncEngine(engine=llm.engine), gate, "tiny")) as http:
        assert http.get("/dashboard/data", headers=bearer(tenant)).status_code == 403
    gate.close()


def test_spend_and_tenant_cost_come_from_the_ledger(ledger_server):
    http, admin, tenant, tenant_key = ledger_server
    response = http.post(
        "/v1/completions",
        headers=bearer(tenant),
        json={"model": "tiny", "prompt": "Hello", "max_tokens": 4, "service_tier": "flex"},
    )
    assert response.status_code == 200
    ledger = http.get("/dashboard/data", headers=bearer(admin)).json()["ledger"]
    [acme] = [row for row in ledger["budgets"] if row["key_id"] == tenant_key.key_id]
    assert (acme["budget"], acme["period"], acme["tenant"]) == (2.0, "day", "acme")
    [report] = [row for row in ledger["tenants"] if row["tenant"] == "acme"]
    assert acme["spent"] == pytest.approx(report["cost"]) and acme["spent"] > 0
    usage = response.json()["usage"]
    assert report["tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert report["cost_per_1k_tokens"] == pytest.approx(report["cost"] / report["tokens"] * 1000)


def test_without_a_ledger_any_key_the_server_accepts_reads_it(llm):
    app = create_app(AsyncEngine(engine=llm.engine), OpenGate(["sk-one"]), "tiny")
    with TestClient(app) as http:
        assert http.get("/dashboard/data").status_code == 401
        document = http.get("/dashboard/data", headers=bearer("sk-one")).json()
        assert document["ledger"] is None and document["batches"] is None


def test_the_data_are_the_metrics(llm):
    app = create_app(AsyncEngine(engine=llm.engine), model_name="tiny")
    with TestClient(app) as http:
        for tier in ("priority", "flex"):
            assert (
                http.post(
                    "/v1/completions",
                    json={"model": "tiny", "prompt": "Hi", "max_tokens": 3, "service_tier": tier, "ignore_eos": True},
                ).status_code
                == 200
            )
        [model] = http.get("/dashboard/data").json()["models"]
        metrics = {}
        for family in text_string_to_metric_families(http.get("/metrics").text):
            for sample in family.samples:
                key = sample.name, sample.labels.get("tier")
                metrics[key] = metrics.get(key, 0) + sample.value
    finished = sum(v for (n, _), v in metrics.items() if n == "carpool:request_success_total")
    assert model["totals"]["requests"] == finished == 2
    generated = sum(v for (n, _), v in metrics.items() if n == "carpool:generation_tokens_total")
    assert model["totals"]["generation_tokens"] == generated == 6
    assert model["gauges"]["kv_cache_usage"] == metrics[("carpool:kv_cache_usage_perc", None)]
    window = model["window"]
    for tier in ("priority", "flex"):
        assert window["ttft"][tier]["count"] == metrics[("carpool:time_to_first_token_seconds_count", tier)] == 1
    assert window["ttft"]["default"] == {"p50": None, "p99": None, "count": 0}
    for tier in ("priority", "flex"):  # 3 tokens, 2 gaps each; the engine's own series counts the same gaps
        assert window["itl"][tier]["count"] == metrics[("carpool:inter_token_latency_by_tier_seconds_count", tier)] == 2
    assert window["itl"]["default"]["count"] == 0 and metrics[("carpool:inter_token_latency_seconds_count", None)] == 4
    assert sum(bucket["count"] for bucket in window["step_seqs"]) == metrics[("carpool:iteration_seqs_count", None)]
    assert model["queued"] == {"priority": 0, "default": 0, "flex": 0, "batch": 0}


def test_quantiles_interpolate_within_a_bucket_as_prometheus_does():
    registry = CollectorRegistry()
    histogram = Histogram("h", "test", buckets=(1.0, 2.0, 4.0), registry=registry)
    for value in (0.5, 1.5, 1.5, 3.0):  # counts per bucket: 1, 2, 1
        histogram.observe(value)
    cumulative = buckets(read_samples(registry), "h")
    assert cumulative == [(1.0, 1), (2.0, 3), (4.0, 4), (math.inf, 4)]
    # The median is rank 2 of 4: halfway through the (1, 2] bucket, which holds ranks 2 and 3.
    assert quantile(0.5, cumulative) == 1.0 + (2.0 - 1.0) * (2 - 1) / (3 - 1)
    assert quantile(0.99, cumulative) == 2.0 + (4.0 - 2.0) * (3.96 - 3) / (4 - 3)
    histogram.observe(100.0)  # past every finite bound: the largest finite bound is all one can say
    assert quantile(0.99, buckets(read_samples(registry), "h")) == 4.0
    assert quantile(0.5, []) is None


def test_the_window_is_the_newest_reading_old_enough(monkeypatch):
    registry = CollectorRegistry()
    counter = Counter("c", "test", registry=registry)
    clock = [1000.0]
    monkeypatch.setattr(data_module.time, "time", lambda: clock[0])
    data = DashboardData(registry, [], started=900.0)

    def window_after(seconds: float) -> float:
        clock[0] += seconds
        counter.inc()
        return data.document()["window_seconds"]

    assert window_after(0) == 100  # nothing remembered yet: since the server started
    assert window_after(2) == 102  # a reading 2 s old is too young to be a window
    assert window_after(3) == 5  # the oldest reading old enough
    for _ in range(20):
        window_after(2)
    assert window_after(2) == pytest.approx(30, abs=2)  # the newest reading at least 30 s old
