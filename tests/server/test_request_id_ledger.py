"""The ledger's request_id is the x-request-id the client saw, and a billed id is billed once: a second request
sent under an id already billed runs, but its row is written withheld (no cost, its spend refunded) and its client
is answered 409 instead of the result. One request of n choices is one row; its parts (compression, a cascade's
attempts) are rows named after it."""

import asyncio
import sqlite3

import httpx
import pytest

from carpool.economics import keys as key_store
from carpool.economics.ledger_gate import LedgerGate
from carpool.economics.prices import load_price_sheet
from carpool.server.app import create_app

CHAT = "/v1/chat/completions"
BODY = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "temperature": 0}


def post(app, body: dict, headers: dict) -> httpx.Response:
    async def send():
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://carpool", timeout=60
        ) as client:
            return await client.post(CHAT, json=body, headers=headers)

    return asyncio.run(send())


def test_the_ledger_row_is_named_by_the_clients_request_id_and_billed_once(ledger_app):
    app, gate, conn = ledger_app
    _, secret = key_store.create_key(conn, "acme", budget=1.0, budget_period="day")
    headers = {"Authorization": f"Bearer {secret}", "x-request-id": "client-trace-42"}
    first = post(app, BODY | {"n": 2}, headers)
    assert first.status_code == 200 and first.headers["x-request-id"] == "client-trace-42"
    spent = gate.key_spend()[0][1]["day"]
    again = post(app, BODY, headers)
    assert again.status_code == 409, again.text
    assert again.json()["error"]["code"] == "duplicate_request_id" and "client-trace-42" in again.text
    gate.flush(timeout=30)
    rows = conn.execute("SELECT request_id, finish_reason, cost, output_tokens FROM ledger ORDER BY id").fetchall()
    assert [tuple(row[:2]) for row in rows] == [("client-trace-42", "length"), ("client-trace-42", "withheld")]
    assert rows[0][2] > 0 and rows[1][2] == 0 and rows[0][3] == 6  # n=2 choices: one row, both billed
    assert gate.key_spend()[0][1]["day"] == pytest.approx(spent)  # the withheld run refunded
    assert post(app, BODY, headers | {"x-request-id": "client-trace-43"}).status_code == 200


def test_a_request_without_an_id_is_billed_under_the_one_the_server_gave_it(engine, tmp_path):
    db = tmp_path / "carpool.db"
    gate = LedgerGate(db, load_price_sheet(None))
    app = create_app(engine, gate, model_name="tiny")
    try:
        given = [post(app, BODY, {}).headers["x-request-id"] for _ in range(2)]
        gate.flush(timeout=30)
        rows = sqlite3.connect(db).execute("SELECT request_id FROM ledger ORDER BY id").fetchall()
        assert [row[0] for row in rows] == given and given[0] != given[1] and given[0].startswith("req_")
    finally:
        gate.close()
