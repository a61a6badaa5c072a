import json

import pytest
from economics_helpers import FOOTPRINT, HARDWARE, PHASES, TEST_SHEET, usage

from carpool.cli import main
from carpool.economics import cli as economics_cli
from carpool.economics.db import connect
from carpool.economics.keys import find_key
from carpool.economics.ledger_gate import LedgerGate
from carpool.economics.prices import load_price_sheet


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_keys_create_list_revoke_set_budget(capsys, db_path):
    db = ["--db", str(db_path)]
    code, secret, err = run(
        capsys,
        "keys",
        "create",
        "--tenant",
        "acme",
        "--tiers",
        "default,flex",
        "--budget",
        "10",
        "--budget-period",
        "day",
        "--rpm",
        "60",
        "--tpm",
        "10000",
        *db,
    )
    secret = secret.strip()
    assert code == 0 and secret.startswith("sk-cp-") and "shown only once" in err
    key = find_key(connect(db_path), secret)
    assert (key.tenant, key.allowed_tiers, key.budget, key.budget_period, key.rpm, key.tpm) == (
        "acme",
        frozenset({"default", "flex"}),
        10.0,
        "day",
        60,
        10000,
    )
    assert run(capsys, "keys", "create", "--tenant", "ops", "--admin", *db)[0] == 0
    assert (
        run(capsys, "keys", "create", "--tenant", "audit", "--scope", "files:read-all", "--scope", "usage:read", *db)[0]
        == 0
    )

    code, table, _ = run(capsys, "keys", "list", *db)
    assert code == 0 and key.key_id in table and "$10/day" in table and secret not in table
    code, listing, _ = run(capsys, "keys", "list", "--format", "json", *db)
    assert [(k["tenant"], k["scopes"]) for k in json.loads(listing)] == [
        ("acme", []),
        ("ops", ["usage:read", "batches:read-all"]),
        ("audit", ["usage:read", "files:read-all"]),
    ]

    assert run(capsys, "keys", "set-budget", key.key_id, "--budget", "2.5", *db)[1].strip() == (
        f"{key.key_id}: budget $2.5 per month"
    )
    assert run(capsys, "keys", "set-budget", key.key_id, "--clear", *db)[1].strip() == f"{key.key_id}: no budget"
    assert run(capsys, "keys", "revoke", key.key_id, *db)[0] == 0
    assert "revoked" in run(capsys, "keys", "list", *db)[1]


def test_keys_errors_exit_2_with_a_message(capsys, db_path):
    code, _, err = run(capsys, "keys", "revoke", "key_nope", "--db", str(db_path))
    assert code == 2 and "no key with id 'key_nope'" in err
    with pytest.raises(SystemExit):
        main(["keys", "create", "--tenant", "a", "--tiers", "gold", "--db", str(db_path)])


def test_db_defaults_to_carpool_db(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("CARPOOL_DB", str(tmp_path / "env.db"))
    assert run(capsys, "keys", "create", "--tenant", "acme")[0] == 0
    assert (tmp_path / "env.db").exists()


def test_cost_report(capsys, db_path, prices):
    gate = LedgerGate(db_path, prices)
    gate.record(gate.authenticate(None), usage(tier="priority"))
    gate.record(gate.authenticate(None), usage(tier="batch"))
    gate.close()
    code, out, _ = run(capsys, "cost", "report", "--group-by", "tier", "--format", "json", "--db", str(db_path))
    assert code == 0
    assert {row["group"]: row["cost"] for row in json.loads(out)["data"]} == pytest.approx(
        {"priority": 0.0036, "batch": 0.0009}
    )
    code, out, _ = run(capsys, "cost", "report", "--format", "csv", "--db", str(db_path))
    assert out.splitlines()[1].startswith("anonymous,2,2000,0,0,0,0,400,2400,")


METRICS_TEXT = """\
# TYPE carpool:engine_phase_tokens counter
carpool:engine_phase_tokens_total{phase="prefill"} 100000.0
carpool:engine_phase_tokens_total{phase="decode"} 20000.0
# TYPE carpool:engine_phase_seconds counter
carpool:engine_phase_seconds_total{phase="prefill"} 10.0
carpool:engine_phase_seconds_total{phase="decode"} 40.0
# TYPE carpool:decode_steps counter
carpool:decode_steps_total 1000.0
# TYPE carpool:decode_step_seconds counter
carpool:decode_step_seconds_total 30.0
# TYPE carpool:decode_step_sequences counter
carpool:decode_step_sequences_total 16000.0
# TYPE carpool:decode_step_context_tokens counter
carpool:decode_step_context_tokens_total 8000000.0
"""


@pytest.fixture
def measured(monkeypatch):
    """The cost model's measurements of this machine and model, replaced by the test's figures."""
    monkeypatch.setattr(economics_cli, "measure_hardware", lambda device: HARDWARE)
    monkeypatch.setattr(economics_cli, "model_footprint", lambda path, dtype, quantization: FOOTPRINT)


@pytest.mark.parametrize("source", ["bench", "metrics"])
def test_cost_model_from_bench_json_or_saved_metrics(capsys, tmp_path, measured, source):
    sheet = tmp_path / "prices.toml"
    sheet.write_text(TEST_SHEET)
    if source == "bench":
        path = tmp_path / "bench.json"
        path.write_text(json.dumps({"runs": [], "phases": PHASES.as_dict()}))
    else:  # what a server with the PhaseMeter registered shows in /metrics
        path = tmp_path / "metrics.txt"
        path.write_text(METRICS_TEXT)
    code, out, _ = run(
        capsys,
        "cost",
        "model",
        "--hourly-price",
        "3.60",
        f"--{source}",
        str(path),
        "--prices",
        str(sheet),
        "--format",
        "json",
    )
    assert code == 0
    model = json.loads(out)
    assert model["tiers"][0] == pytest.approx(
        {
            "tier": "priority",
            "input_per_1m": 0.2,
            "output_per_1m": 4.0,
            "list_input_per_1m": 2.0,
            "list_output_per_1m": 8.0,
        }
    )
    assert model["decode"]["bound"] == "memory bandwidth"


def test_cost_prices_writes_a_sheet_that_covers_the_machine_at_the_target(capsys, tmp_path, measured):
    """$3.60/hour is $0.001 a second: at 10,000 prompt and 500 output tokens a busy second, $0.10 and $2.00 per
    1M at full load; at half the hour busy and a 20% margin, $0.24 and $4.80."""
    sheet, bench, out = tmp_path / "prices.toml", tmp_path / "bench.json", tmp_path / "suggested.toml"
    sheet.write_text(TEST_SHEET + '\n[models."other"]\ninput = 0.5\noutput = 1.5\n')
    bench.write_text(json.dumps({"phases": PHASES.as_dict()}))
    measure = ["--hourly-price", "3.60", "--bench", str(bench), "--prices", str(sheet)]
    code, _, err = run(
        capsys, "cost", "prices", *measure, "--target-utilization", "0.5", "--margin", "0.2", "--out", str(out)
    )
    assert code == 0, err
    current, suggested = load_price_sheet(sheet), load_price_sheet(out)
    price = suggested.price("test-model")
    assert (price.input, price.output) == pytest.approx((0.24, 4.8))
    assert suggested.models["other"] == current.models["other"]
    assert (suggested.tiers, suggested.cache_read, suggested.cache_write) == (
        current.tiers,
        current.cache_read,
        current.cache_write,
    )
    # The listed $4 output breaks even at 50% busy in the default tier, 100% in flex and batch (half the price).
    tiers = {line.split()[0]: line for line in err.splitlines()[4:]}
    assert "10% / 50%" in tiers["default"] and "below cost" not in tiers["default"]
    assert "100%" in tiers["flex"] and "below cost" in tiers["flex"] and "below cost" in tiers["batch"]
    code, _, err = run(capsys, "cost", "prices", *measure, "--target-utilization", "1.5")
    assert code == 2 and "target utilization must be in (0, 1]" in err


def test_cost_model_stops_on_a_bad_price_sheet(capsys, tmp_path, measured):
    sheet = tmp_path / "prices.toml"
    sheet.write_text(TEST_SHEET.replace("output = 4.0", "output = -4.0"))
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps({"phases": PHASES.as_dict()}))
    code, _, err = run(capsys, "cost", "model", "--hourly-price", "1.2", "--bench", str(bench), "--prices", str(sheet))
    assert code == 2 and 'models."test-model".output must not be negative' in err


def test_budget_period_without_budget_and_bad_times_are_refused(capsys, db_path):
    code, _, err = run(capsys, "keys", "create", "--tenant", "a", "--budget-period", "day", "--db", str(db_path))
    assert code == 2 and "needs a budget amount" in err
    with pytest.raises(SystemExit):
        main(["cost", "report", "--start", "last tuesday", "--db", str(db_path)])
    assert "ISO 8601" in capsys.readouterr().err
