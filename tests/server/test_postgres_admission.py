"""A server whose gate is on PostgreSQL (started by the suite: conftest.postgres_server): key lookups and admission
are round trips to the database, run off the event loop, and a database that cannot be reached is a retryable 503
in OpenAI's error body, never a 500, while every request that was answered 200 keeps its ledger row."""

import asyncio
import json
import socket
import threading
import time

import httpx

from carpool.economics import keys as key_store
from carpool.economics.db import open_database
from carpool.economics.ledger_gate import LedgerGate
from carpool.economics.prices import load_price_sheet
from carpool.postgres import connect_postgres
from carpool.server.app import create_app

CHAT = "/v1/chat/completions"
BODY = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "temperature": 0}


def new_key(url: str) -> tuple[str, str]:
    conn = open_database(url)
    try:
        key, secret = key_store.create_key(conn, "acme", budget=100.0, budget_period="day", rpm=1000)
        return key.key_id, secret
    finally:
        conn.close()


def send(app, secret: str, *requests: tuple) -> list[tuple[httpx.Response, float]]:
    """The requests (method, path, body[, seconds to wait before sending]) together, on one event loop as a server
    has; each response with when it came (seconds)."""

    async def one(client, method, path, body, started, delay=0.0):
        await asyncio.sleep(delay)
        response = await client.request(method, path, json=body, headers={"Authorization": f"Bearer {secret}"})
        return response, time.monotonic() - started

    async def all_of_them():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://carpool") as client:
            started = time.monotonic()
            return await asyncio.gather(*(one(client, *request[:3], started, *request[3:]) for request in requests))

    return asyncio.run(all_of_them())


def closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def cut_off(conn, postgres_url: str) -> str:
    """The database is unreachable from this connection: its session ends and a new one dials a closed port."""
    url, conn.url = conn.url, f"postgresql://nobody@127.0.0.1:{closed_port()}/gone"
    killer = connect_postgres(postgres_url)
    pid = conn.raw.info.backend_pid
    killer.execute("SELECT pg_terminate_backend(?)", (pid,))
    while killer.execute("SELECT COUNT(*) FROM pg_stat_activity WHERE pid = ?", (pid,)).fetchone()[0]:
        time.sleep(0.01)
    killer.close()
    return url


def paid_rows(postgres_url: str) -> int:
    conn = open_database(postgres_url)
    try:
        return conn.execute("SELECT COUNT(*) FROM ledger WHERE finish_reason <> 'withheld'").fetchone()[0]
    finally:
        conn.close()


def test_an_unreachable_database_is_a_retryable_503_and_no_answered_request_loses_its_row(engine, postgres_url):
    _, secret = new_key(postgres_url)
    gate = LedgerGate(postgres_url, load_price_sheet(None))
    app = create_app(engine, gate, model_name="tiny")
    try:
        assert [r.status_code for r, _ in send(app, secret, ("POST", CHAT, BODY))] == [200]
        admission = gate._admission._conn
        admission_url = cut_off(admission, postgres_url)  # admission's database is gone (the keys' still answers)
        lookups_url = None
        for stage in ("admission", "key lookup"):
            ((refused, _),) = send(app, secret, ("POST", CHAT, BODY))
            assert refused.status_code == 503, (stage, refused.text)
            error = refused.json()["error"]
            assert error["type"] == "server_error" and error["code"] == "database_unavailable", (stage, error)
            assert "cannot be reached" in error["message"] and refused.headers["Retry-After"] == "1"
            lookups_url = lookups_url or cut_off(gate._conn, postgres_url)  # then every statement fails
        admission.url = admission_url
        gate._conn.url = lookups_url
        assert [r.status_code for r, _ in send(app, secret, ("POST", CHAT, BODY))] == [200]  # healed
        gate.flush(timeout=10)
        assert paid_rows(postgres_url) == 2  # one row per 200, none for a refusal
    finally:
        gate.close()


def test_admission_waiting_on_the_database_does_not_hold_up_the_event_loop(engine, postgres_url):
    key_id, secret = new_key(postgres_url)
    gate = LedgerGate(postgres_url, load_price_sheet(None))
    app = create_app(engine, gate, model_name="tiny")
    blocker = connect_postgres(postgres_url)
    try:
        # Another replica's admission of the same key holds the key's lock for 1.5 s (a slow database, or a
        # partition, looks the same from here).
        results: list = []
        sender = threading.Thread(
            target=lambda: results.extend(send(app, secret, ("POST", CHAT, BODY), ("GET", "/health", None, 0.3)))
        )  # once the chat waits
        with blocker:
            blocker.execute("SELECT pg_advisory_xact_lock(hashtextextended(?, 0))", (key_id,))
            sender.start()
            time.sleep(1.5)
        sender.join(timeout=30)
        (chat, chat_at), (health, health_at) = results
        assert chat.status_code == 200 and chat_at >= 1.4  # it waited for the lock
        assert health.status_code == 200 and health_at < 1.0  # the loop served others meanwhile (0.3 s)
    finally:
        blocker.close()
        gate.close()


def test_batch_lines_wait_out_an_unreachable_database_instead_of_failing(engine, postgres_url, tmp_path):
    from fastapi.testclient import TestClient

    _, secret = new_key(postgres_url)
    gate = LedgerGate(postgres_url, load_price_sheet(None))
    app = create_app(engine, gate, model_name="tiny", batch_dir=str(tmp_path / "batches"), batch_db=postgres_url)
    requests = "".join(
        json.dumps(
            {
                "custom_id": f"c{i}",
                "method": "POST",
                "url": "/v1/completions",
                "body": {"prompt": f"{i}, {i + 1},", "max_tokens": 2},
            }
        )
        + "\n"
        for i in range(4)
    )
    auth = {"Authorization": f"Bearer {secret}"}
    try:
        with TestClient(app) as http:
            upload = http.post(
                "/v1/files", files={"file": ("in.jsonl", requests.encode())}, data={"purpose": "batch"}, headers=auth
            ).json()
            admission = gate._admission._conn
            batch = http.post(
                "/v1/batches",
                json={"input_file_id": upload["id"], "endpoint": "/v1/completions", "completion_window": "24h"},
                headers=auth,
            ).json()
            url = cut_off(admission, postgres_url)  # before its lines are admitted (validation comes first)
            threading.Timer(1.5, setattr, (admission, "url", url)).start()  # back 1.5 s later
            deadline = time.monotonic() + 60
            while batch["status"] not in ("completed", "failed", "expired", "cancelled"):
                assert time.monotonic() < deadline, batch
                time.sleep(0.05)
                batch = http.get(f"/v1/batches/{batch['id']}", headers=auth).json()
        assert batch["status"] == "completed" and batch["request_counts"]["completed"] == 4, batch
    finally:
        gate.close()
