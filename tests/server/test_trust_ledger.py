"""No lost ledger row: a request's row is committed before its client has the whole response, and a ledger that
cannot write refuses billable work (503) and says so on /health and /metrics instead of answering 200."""

import asyncio
import sqlite3
import threading
import time

import httpx
import pytest
from ledger_faults import fill_disk
from live_server import LiveServer

from carpool.economics.ledger_gate import LedgerGate
from carpool.economics.prices import load_price_sheet
from carpool.server.app import create_app

CHAT = "/v1/chat/completions"
BODY = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "temperature": 0}


@pytest.fixture
def db(tmp_path):
    return tmp_path / "carpool.db"


def request(app, method: str, path: str, body: dict | None = None) -> httpx.Response:
    async def send():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://carpool") as client:
            return await client.request(method, path, json=body)

    return asyncio.run(send())


def ledger_rows(db) -> int:
    return sqlite3.connect(db).execute("SELECT COUNT(*) FROM ledger").fetchone()[0]


@pytest.mark.parametrize("stream", [False, True])
def test_the_row_is_committed_before_the_client_has_the_response(engine, db, stream):
    gate = LedgerGate(db, load_price_sheet(None))
    app = create_app(engine, gate, model_name="tiny")
    blocker = sqlite3.connect(db, isolation_level=None, check_same_thread=False)
    blocker.execute("BEGIN IMMEDIATE")  # the ledger cannot commit for the next second, as during a backup
    release = threading.Timer(1.0, blocker.execute, ("COMMIT",))
    release.start()
    try:
        response = request(app, "POST", CHAT, BODY | {"stream": stream})
        assert response.status_code == 200, response.text
        assert not stream or response.text.rstrip().endswith("data: [DONE]")
        assert ledger_rows(db) == 1  # the moment the client has it all: no sleep, no flush
    finally:
        release.join()
        gate.close()


def test_a_ledger_that_cannot_write_stops_billable_work(engine, db, monkeypatch):
    disk = fill_disk(monkeypatch)
    gate = LedgerGate(db, load_price_sheet(None))
    app = create_app(engine, gate, model_name="tiny")
    gate.register_metrics(app.state.metrics.registry)
    try:
        withheld = request(app, "POST", CHAT, BODY)  # it ran, but without its row it must not read as a success
        assert withheld.status_code == 503, withheld.text
        assert withheld.json()["error"]["code"] == "ledger_unavailable"
        assert "database or disk is full" in withheld.json()["error"]["message"]
        refused = request(app, "POST", CHAT, BODY)
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "ledger_unavailable"
        assert "Retry-After" in refused.headers
        health = request(app, "GET", "/health")
        assert health.status_code == 503 and "database or disk is full" in health.json()["error"]["message"]
        assert "carpool:ledger_healthy 0.0" in request(app, "GET", "/metrics").text
        assert request(app, "POST", "/tokenize", {"prompt": "Hi"}).status_code == 200  # nothing billed: served

        disk.full = False
        deadline = time.monotonic() + 30
        while request(app, "GET", "/health").status_code != 200 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert request(app, "GET", "/health").status_code == 200
        assert "carpool:ledger_healthy 1.0" in request(app, "GET", "/metrics").text
        assert request(app, "POST", CHAT, BODY).status_code == 200
        assert ledger_rows(db) == 2  # the withheld request ran: its row was kept and written once it could be
    finally:
        gate.close()


def test_kill_9_right_after_the_responses_loses_no_row(tmp_path):
    server = LiveServer(home=str(tmp_path))
    try:
        client = server.client()
        model = client.models.list().data[0].id
        for i in range(2):
            client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": f"Say {i}."}], max_tokens=2, temperature=0
            )
    finally:
        server.kill()
    assert ledger_rows(tmp_path / "carpool.db") == 2
