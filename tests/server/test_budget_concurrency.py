"""Budgets hold under concurrency on both stores: 20 requests at once against a budget of about three requests'
worst case admit only what fits (each admitted request reserves its prompt and max_tokens at the model's dearest
rate until its row settles the real cost), and the key's spend stays within its budget."""

import asyncio

import httpx
import pytest

from carpool.economics import keys as key_store
from carpool.economics.db import open_database
from carpool.economics.ledger_gate import LedgerGate
from carpool.economics.prices import load_price_sheet
from carpool.server.app import create_app

CHAT = "/v1/chat/completions"
MESSAGES = [{"role": "user", "content": "Count from one to ten."}]
MAX_TOKENS = 8


def send_together(app, secret: str | None, bodies: list[tuple[str, dict]]) -> list[httpx.Response]:
    headers = {"Authorization": f"Bearer {secret}"} if secret else {}

    async def all_of_them():
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://carpool", timeout=120
        ) as client:
            return await asyncio.gather(*(client.post(path, json=body, headers=headers) for path, body in bodies))

    return asyncio.run(all_of_them())


@pytest.mark.parametrize("store", ["sqlite", "postgresql"])
def test_twenty_requests_at_once_spend_no_more_than_a_budget_of_three(engine, tmp_path, request, store):
    db = request.getfixturevalue("postgres_url") if store == "postgresql" else str(tmp_path / "carpool.db")
    prices = load_price_sheet(None)
    gate = LedgerGate(db, prices)
    app = create_app(engine, gate, model_name="tiny")
    conn = open_database(db)
    try:
        (counted,) = send_together(app, None, [("/tokenize", {"messages": MESSAGES})])  # no keys yet: open
        worst = prices.worst_case_cost("default", counted.json()["count"] + MAX_TOKENS, ("tiny",))
        budget = 3.5 * worst
        key, secret = key_store.create_key(conn, "acme", budget=budget, budget_period="day")
        body = {"model": "tiny", "messages": MESSAGES, "max_tokens": MAX_TOKENS, "temperature": 0}
        responses = send_together(app, secret, [(CHAT, body)] * 20)
        gate.flush(timeout=30)

        answered = [r for r in responses if r.status_code == 200]
        refused = [r.json()["error"] for r in responses if r.status_code != 200]
        assert 1 <= len(answered) <= 3, [r.text for r in responses]
        assert {r.status_code for r in responses} <= {200, 429}
        assert all(error["code"] == "insufficient_quota" for error in refused)
        # Past the third, what is left of the budget cannot hold a worst case: the refusal names max_tokens.
        assert any(error["param"] == "max_tokens" and "max_tokens" in error["message"] for error in refused)
        (spent, rows) = conn.execute(
            "SELECT COALESCE(SUM(cost), 0), COUNT(*) FROM ledger WHERE key_id = ?", (key.key_id,)
        ).fetchone()
        assert rows == len(answered) and 0 < spent <= budget
        if store == "sqlite":
            assert gate._admission.reserved(key.key_id) == 0  # every reservation settled by its row
        else:
            assert conn.execute("SELECT COUNT(*) FROM reservations").fetchone()[0] == 0
    finally:
        conn.close()
        gate.close()


def test_a_budget_smaller_than_a_cent_is_printed_as_it_is(engine, tmp_path):
    db = tmp_path / "carpool.db"
    gate = LedgerGate(db, load_price_sheet(None))
    app = create_app(engine, gate, model_name="tiny")
    conn = open_database(db)
    try:
        _, secret = key_store.create_key(conn, "acme", budget=0.00006, budget_period="day")
        body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 1000, "temperature": 0}
        (refused,) = send_together(app, secret, [(CHAT, body)])
        assert refused.status_code == 429, refused.text
        message = refused.json()["error"]["message"]
        assert "budget of $0.00006 per day" in message and "$0.0001" not in message
    finally:
        conn.close()
        gate.close()
