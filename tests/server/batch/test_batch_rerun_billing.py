"""Batch lines a server leaves for another run (it stops, or lost the batch's lease) are not billed: their rows are
written withheld, at no cost, and the run that answers them bills them once. Lines a client's cancellation stops
are billed for what they used, as an aborted live request is. And a Batch API line may name a cascade."""

import json
import sqlite3
import time

from fastapi.testclient import TestClient

from carpool.economics.ledger_gate import LedgerGate
from carpool.economics.prices import load_price_sheet
from carpool.engine.async_engine import AsyncEngine
from carpool.engine.config import EngineConfig
from carpool.server.app import create_app
from carpool.server.cascade.config import Cascade, Step
from carpool.server.cascade.scorers import Scorer

TERMINAL = {"completed", "failed", "expired", "cancelled"}


def long_lines(count: int) -> bytes:
    """Lines that run long enough (300 tokens, EOS ignored) to be caught in flight."""
    body = {"max_tokens": 300, "temperature": 0, "ignore_eos": True}
    return "".join(
        json.dumps(
            {"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions", "body": body | {"prompt": f"{i}"}}
        )
        + "\n"
        for i in range(count)
    ).encode()


def start_batch(http: TestClient, data: bytes, endpoint: str = "/v1/completions") -> dict:
    file_id = http.post("/v1/files", files={"file": ("in.jsonl", data)}, data={"purpose": "batch"}).json()["id"]
    return http.post(
        "/v1/batches", json={"input_file_id": file_id, "endpoint": endpoint, "completion_window": "24h"}
    ).json()


def wait_for_decoding(engine: AsyncEngine) -> None:
    deadline = time.monotonic() + 60
    while engine.snapshot().num_running < 2:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    time.sleep(0.5)  # some tokens decoded: an abort now would be billed for them


def ledger(db) -> list[tuple[str, float]]:
    return sqlite3.connect(db).execute("SELECT finish_reason, cost FROM ledger").fetchall()


def test_lines_a_stopping_server_leaves_for_a_rerun_are_not_billed(tmp_path):
    db = tmp_path / "carpool.db"
    gate = LedgerGate(db, load_price_sheet(None))
    engine = AsyncEngine(EngineConfig(max_num_seqs=2, num_kv_blocks=64))
    try:
        with TestClient(create_app(engine, gate, "smol", batch_dir=str(tmp_path / "batches"))) as http:
            start_batch(http, long_lines(4))
            wait_for_decoding(engine)
        gate.flush(timeout=30)
        rows = ledger(db)
        assert len(rows) == 2 and rows == [("withheld", 0.0)] * 2, rows
    finally:
        gate.close()


def test_lines_a_cancelled_batch_stops_are_billed_for_what_they_used(tmp_path):
    db = tmp_path / "carpool.db"
    gate = LedgerGate(db, load_price_sheet(None))
    engine = AsyncEngine(EngineConfig(max_num_seqs=2, num_kv_blocks=64))
    try:
        with TestClient(create_app(engine, gate, "smol", batch_dir=str(tmp_path / "batches"))) as http:
            batch = start_batch(http, long_lines(4))
            wait_for_decoding(engine)
            http.post(f"/v1/batches/{batch['id']}/cancel")
            deadline = time.monotonic() + 60
            while http.get(f"/v1/batches/{batch['id']}").json()["status"] not in TERMINAL:
                assert time.monotonic() < deadline
                time.sleep(0.02)
        gate.flush(timeout=30)
        rows = ledger(db)
        assert len(rows) == 2 and all(reason == "abort" and cost > 0 for reason, cost in rows), rows
    finally:
        gate.close()


def test_a_batch_line_may_name_a_cascade(tmp_path):
    db = tmp_path / "carpool.db"
    gate = LedgerGate(db, load_price_sheet(None))
    engine = AsyncEngine(EngineConfig(max_num_seqs=2, num_kv_blocks=64))
    # A threshold no logprob mean reaches: the cheap step always escalates to the last, which answers.
    cascade = Cascade("casc", (Step("smol", Scorer("mean"), 1.0), Step("smol")))
    line = {
        "custom_id": "q",
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"model": "casc", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "temperature": 0},
    }
    try:
        app = create_app(engine, gate, "smol", batch_dir=str(tmp_path / "batches"), cascades={"casc": cascade})
        with TestClient(app) as http:
            batch = start_batch(http, (json.dumps(line) + "\n").encode(), "/v1/chat/completions")
            deadline = time.monotonic() + 60
            while (batch := http.get(f"/v1/batches/{batch['id']}").json())["status"] not in TERMINAL:
                assert time.monotonic() < deadline
                time.sleep(0.02)
            assert batch["status"] == "completed" and batch["request_counts"]["completed"] == 1, batch
            (answer,) = [
                json.loads(text) for text in http.get(f"/v1/files/{batch['output_file_id']}/content").text.splitlines()
            ]
        assert answer["response"]["status_code"] == 200 and answer["response"]["body"]["model"] == "smol"
        gate.flush(timeout=30)
        rows = (
            sqlite3.connect(db)
            .execute(
                "SELECT request_id, parent_request_id, cascade_step, cascade_accepted FROM ledger ORDER BY cascade_step"
            )
            .fetchall()
        )
        client_id = answer["response"]["request_id"]
        assert rows == [(f"{client_id}#cascade-0", client_id, 0, 0), (f"{client_id}#cascade-1", client_id, 1, 1)]
    finally:
        gate.close()
