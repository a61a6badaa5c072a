"""Every batch line is admitted through the gate like a live request, with its key as it stands when the line
runs: after a restart (budgets and revocations still hold) and when the key is revoked mid-batch."""

import io
import json
import sqlite3
import time

import pytest
from fastapi.testclient import TestClient

from carpool.economics.contract import SCOPES
from carpool.economics.db import connect
from carpool.economics.keys import create_key, revoke_key
from carpool.economics.ledger_gate import LedgerGate
from carpool.economics.prices import load_price_sheet
from carpool.engine.async_engine import AsyncEngine
from carpool.engine.config import EngineConfig
from carpool.server.app import create_app
from carpool.server.batch.store import BatchStore

TERMINAL = {"completed", "failed", "expired", "cancelled"}


def lines(count: int, max_tokens: int = 2) -> bytes:
    return "".join(
        json.dumps(
            {
                "custom_id": f"c{i}",
                "method": "POST",
                "url": "/v1/completions",
                "body": {"prompt": f"{i}, {i + 1},", "max_tokens": max_tokens, "temperature": 0},
            }
        )
        + "\n"
        for i in range(count)
    ).encode()


def serve(tmp_path, max_num_seqs: int = 2):
    """The app as `carpool serve` builds it, on the test's database and batch dir (not yet started)."""
    engine = AsyncEngine(EngineConfig(max_num_seqs=max_num_seqs, num_kv_blocks=64))
    return create_app(
        engine, LedgerGate(tmp_path / "carpool.db", load_price_sheet(None)), "smol", batch_dir=str(tmp_path / "batches")
    )


def wait_for_end(http: TestClient, admin: str, batch_id: str, timeout: float = 120) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        batch = http.get(f"/v1/batches/{batch_id}", headers={"Authorization": f"Bearer {admin}"}).json()
        if batch["status"] in TERMINAL or time.monotonic() > deadline:
            assert batch["status"] in TERMINAL, batch
            return batch
        time.sleep(0.02)


def answers(http: TestClient, admin: str, batch: dict) -> list[dict]:
    found = []
    for file_id in (batch["output_file_id"], batch["error_file_id"]):
        if file_id:
            text = http.get(f"/v1/files/{file_id}/content", headers={"Authorization": f"Bearer {admin}"}).text
            found += [json.loads(line) for line in text.splitlines()]
    return found


def billed(tmp_path, key_id: str) -> int:
    return (
        sqlite3.connect(tmp_path / "carpool.db")
        .execute("SELECT COUNT(*) FROM ledger WHERE key_id = ?", (key_id,))
        .fetchone()[0]
    )


@pytest.mark.parametrize("state", ["budget spent", "revoked"])
def test_after_a_restart_lines_meet_the_key_as_it_stands(tmp_path, state):
    conn = connect(tmp_path / "carpool.db")
    _, admin = create_key(conn, "ops", scopes=SCOPES)
    if state == "budget spent":
        key, _ = create_key(conn, "acme", budget=0.0, budget_period="day")
    else:
        key, _ = create_key(conn, "acme")
        revoke_key(conn, key.key_id)
    # The batch a previous process accepted for this key and never ran.
    store = BatchStore(tmp_path / "batches")
    upload = store.save_file("acme", "in.jsonl", "batch", io.BytesIO(lines(4)), 1 << 20, int(time.time()))
    batch = store.create_batch(
        owner="acme",
        key_id=key.key_id,
        tenant="acme",
        endpoint="/v1/completions",
        input_file_id=upload["id"],
        completion_window="24h",
        metadata=None,
        created_at=int(time.time()),
        expires_at=int(time.time()) + 3600,
    )
    store.close()

    with TestClient(serve(tmp_path)) as http:
        batch = wait_for_end(http, admin, batch["id"])
        answered = answers(http, admin, batch)
    expected = (429, "insufficient_quota") if state == "budget spent" else (401, "invalid_api_key")
    assert sorted(line["custom_id"] for line in answered) == [f"c{i}" for i in range(4)]
    assert {(line["response"]["status_code"], line["response"]["body"]["error"]["code"]) for line in answered} == {
        expected
    }
    assert billed(tmp_path, key.key_id) == 0


def test_a_key_revoked_mid_batch_runs_and_bills_no_more_lines(tmp_path):
    conn = connect(tmp_path / "carpool.db")
    _, admin = create_key(conn, "ops", scopes=SCOPES)
    key, secret = create_key(conn, "acme")
    caller = {"Authorization": f"Bearer {secret}"}
    # One line at a time, slow enough to be caught early.
    with TestClient(serve(tmp_path, max_num_seqs=1)) as http:
        file_id = http.post(
            "/v1/files",
            headers=caller,
            files={"file": ("in.jsonl", lines(12, max_tokens=8))},
            data={"purpose": "batch"},
        ).json()["id"]
        batch = http.post(
            "/v1/batches",
            headers=caller,
            json={"input_file_id": file_id, "endpoint": "/v1/completions", "completion_window": "24h"},
        ).json()
        deadline = time.monotonic() + 120
        while http.get(f"/v1/batches/{batch['id']}", headers=caller).json()["request_counts"]["completed"] < 1:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        revoke_key(conn, key.key_id)
        batch = wait_for_end(http, admin, batch["id"])
        answered = answers(http, admin, batch)
    statuses = [line["response"]["status_code"] for line in answered]
    assert len(statuses) == 12 and set(statuses) == {200, 401}, statuses
    assert billed(tmp_path, key.key_id) == statuses.count(200)  # every billed row is a line that ran
