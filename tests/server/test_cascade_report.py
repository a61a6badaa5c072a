"""The cascade report from ledger rows written by the real ledger gate: share answered by each step, cost of every
attempt, and the estimate of sending everything to the last model (its price for the accepted answer's tokens)."""

import json
from contextlib import closing
from dataclasses import replace

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from carpool.cli import main
from carpool.economics.contract import SCOPES, Principal, UsageRecord
from carpool.economics.db import connect
from carpool.economics.ledger_gate import open_ledger_gate
from carpool.economics.reports import cascade_summary
from carpool.economics.routes import usage_router


def attempt(parent, step, model, accepted, output_tokens, tier="default"):
    return UsageRecord(
        f"{parent}-{step}",
        model,
        tier,
        100,
        40,
        10,
        output_tokens,
        0.0,
        0.1,
        0.2,
        "stop",
        purpose="cascade_attempt",
        parent_request_id=parent,
        cascade="gsm",
        cascade_step=step,
        cascade_accepted=accepted,
    )


def test_shares_cost_and_saving_per_cascade(tmp_path, capsys):
    db = tmp_path / "ledger.db"
    gate = open_ledger_gate(db)
    rows = [
        attempt("a", 0, "qwen2.5-coder-0.5b", True, 50),
        attempt("b", 0, "qwen2.5-coder-0.5b", True, 70, tier="flex"),
        attempt("c", 0, "qwen2.5-coder-0.5b", False, 60),
        attempt("c", 1, "qwen2.5-coder-1.5b", True, 80),
    ]
    plain = UsageRecord("d", "qwen2.5-coder-1.5b", "default", 10, 0, 0, 5, 0.0, 0.0, 0.0, "stop")
    for row in [*rows, plain]:
        gate.record(Principal(), row)
    gate.flush()
    cost = gate.prices.cost
    with closing(connect(db)) as conn:
        (summary,) = cascade_summary(conn, gate.prices)
    assert summary.requests == 3 and summary.answered == {0: 2, 1: 1}
    assert summary.models == {0: "qwen2.5-coder-0.5b", 1: "qwen2.5-coder-1.5b"}
    assert summary.cost == pytest.approx(sum(cost(row) for row in rows))
    as_last = [
        cost(replace(rows[0], model="qwen2.5-coder-1.5b")),
        cost(replace(rows[1], model="qwen2.5-coder-1.5b")),
        cost(rows[3]),
    ]
    assert summary.cost_all_last == pytest.approx(sum(as_last))
    assert 0 < summary.saved == pytest.approx(sum(as_last) - summary.cost)
    app = FastAPI()
    app.include_router(usage_router(gate, caller=lambda: Principal(scopes=frozenset(SCOPES))))
    (served,) = TestClient(app).get("/v1/usage/cascades").json()["data"]
    assert served["saved"] == pytest.approx(summary.saved) and served["requests"] == 3
    gate.close()
    assert main(["cost", "cascades", "--db", str(db), "--format", "json"]) == 0
    (document,) = json.loads(capsys.readouterr().out)["data"]
    assert document["answered_share"] == {"0": pytest.approx(2 / 3), "1": pytest.approx(1 / 3)}


def test_two_keys_sending_the_same_request_id_are_two_requests(tmp_path):
    gate = open_ledger_gate(tmp_path / "ledger.db")
    for key in ("k1", "k2"):
        for row in (
            attempt("same", 0, "qwen2.5-coder-0.5b", False, 60),
            attempt("same", 1, "qwen2.5-coder-1.5b", True, 80),
        ):
            gate.record(Principal(key_id=key), replace(row, request_id=f"{key}-{row.request_id}", key_id=key))
    gate.flush()
    with closing(connect(tmp_path / "ledger.db")) as conn:
        (summary,) = cascade_summary(conn, gate.prices)
    assert summary.requests == 2 and summary.answered == {0: 0, 1: 2}
    gate.close()
