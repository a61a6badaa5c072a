"""Warm start: /health says "warming" (503) until every step shape has run once on the engine thread, requests
sent meanwhile wait and then run, and the warm-up leaves no trace in the engine or its metrics; `carpool serve`
says so too (warm-up on by default, `--no-warmup` to skip it)."""

import os
import subprocess
import sys
import threading
import time

import httpx
import pytest
from live_server import LiveServer, ServedApp

from carpool.engine import async_engine
from carpool.engine.async_engine import AsyncEngine
from carpool.engine.warmup import decode_batch_sizes, warm_up
from carpool.server.app import create_app


@pytest.fixture
def held_warmup(monkeypatch):
    """A warm-up that lasts until the test releases it (what it runs is the last test's business)."""
    release, started = threading.Event(), threading.Event()

    def held(engine):
        started.set()
        assert release.wait(60)

    monkeypatch.setattr(async_engine, "warm_up", held)
    return started, release


def test_health_is_warming_until_the_warmup_ends_and_requests_wait_for_it(llm, held_warmup):
    started, release = held_warmup
    engine = AsyncEngine(engine=llm.engine, warmup=True)
    app = create_app(engine, model_name="tiny")
    with ServedApp(app) as client:
        assert started.wait(60)
        warming = client.get("/health")
        assert (warming.status_code, warming.json()) == (503, {"status": "warming", "models": ["tiny"]})
        answer: dict = {}
        sender = threading.Thread(
            target=lambda: answer.update(
                response=client.post("/v1/completions", json={"model": "tiny", "prompt": "Hello", "max_tokens": 2})
            )
        )
        sender.start()
        time.sleep(0.5)
        assert sender.is_alive(), "a request sent during the warm-up must wait for it"
        release.set()
        sender.join(60)
        assert answer["response"].status_code == 200
        assert answer["response"].json()["usage"]["completion_tokens"] == 2
        assert client.get("/health").json() == {"status": "ok"}


def test_without_warmup_health_is_ready_at_once(llm, held_warmup):
    started, _ = held_warmup
    app = create_app(AsyncEngine(engine=llm.engine), model_name="tiny")
    with ServedApp(app) as client:
        assert client.get("/health").status_code == 200
    assert not started.is_set()


def test_warmup_runs_every_decode_batch_size_and_a_full_budget_prefill_then_leaves_nothing(llm):
    engine = llm.engine
    shapes = []
    real_step = engine.step

    def recording_step():
        outputs = real_step()
        shapes.append((engine.last_step.num_seqs, engine.last_step.num_prefill_tokens))
        return outputs

    engine.step = recording_step
    try:
        report = warm_up(engine)
    finally:
        del engine.step
    decode_sizes = {seqs for seqs, prefill in shapes if prefill == 0}
    assert set(decode_batch_sizes(engine.config.max_num_seqs)) <= decode_sizes
    assert max(prefill for _, prefill in shapes) == engine.config.max_num_batched_tokens
    assert report.steps == len(shapes)
    assert report.decode_tokens_per_second > 0  # the start-up price check's measure (--hourly-price)
    assert not engine.has_unfinished_requests() and not engine.seqs
    assert engine.block_manager.usage() == 0


def test_decode_batch_sizes_cover_up_to_the_slot_count():
    assert decode_batch_sizes(1) == [1]
    assert decode_batch_sizes(8) == [1, 2, 4, 8]
    assert decode_batch_sizes(12) == [1, 2, 4, 8, 12]


class WatchedServer(LiveServer):
    """A live server whose /health answers are recorded, every 20 ms, until the first 200."""

    def _wait_ready(self) -> None:
        self.answers = []
        super()._wait_ready(lambda status, body: self.answers.append((status, body)))


def test_carpool_serve_says_warming_before_it_says_ok_and_warns_of_prices_below_cost():
    """At $1,000 an hour no tier of the shipped sheet covers the machine: each is named once the warm-up has
    measured the decode rate, and the dashboard shows each tier's and tenant's margin below zero."""
    live = WatchedServer("--max-num-seqs", "4", "--hourly-price", "1000", warmup=True)
    try:
        name = httpx.get(f"{live.url}/v1/models").json()["data"][0]["id"]
        deadline = time.monotonic() + 60
        while live.output().count("below the machine's cost") < 4 and time.monotonic() < deadline:
            time.sleep(0.2)
        warnings = [line for line in live.output().splitlines() if "below the machine's cost" in line]
        margin = _margin_after_one_request(live, name)
    finally:
        live.stop()
    assert [row["tenant"] for row in margin["by_tenant"]] == ["acme"] and margin["by_tenant"][0]["revenue"] > 0
    assert [row["tier"] for row in margin["by_tier"]] == ["default"] and margin["by_tier"][0]["margin"] < 0
    assert margin["machine_cost"] > 0 and 0 < margin["utilization"] <= 1
    assert {row["tier"] for row in margin["below_cost"]} == {"priority", "default", "flex", "batch"}
    assert (503, {"status": "warming", "models": [name]}) in live.answers
    assert live.answers[-1] == (200, {"status": "ok"})
    assert [line.split("tier ")[1].split(",")[0] for line in warnings] == ["priority", "default", "flex", "batch"]


def _margin_after_one_request(live: LiveServer, model: str) -> dict:
    """The dashboard's margin panel once an admin key of tenant acme has made one request."""
    created = subprocess.run(
        [sys.executable, "-m", "carpool.cli", "keys", "create", "--tenant", "acme", "--admin"],
        capture_output=True,
        text=True,
        env={**os.environ, "CARPOOL_DB": os.path.join(live.home, "carpool.db")},
        check=True,
    )
    headers = {"Authorization": f"Bearer {created.stdout.split()[0]}"}
    body = {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
    assert httpx.post(f"{live.url}/v1/chat/completions", json=body, headers=headers, timeout=60).status_code == 200
    return httpx.get(f"{live.url}/dashboard/data", headers=headers, timeout=60).json()["ledger"]["margin"]
