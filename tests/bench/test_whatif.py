"""`carpool cost whatif` on a synthetic ledger whose answer is worked by hand: three requests (the second shares
the first's prompt blocks), a step model in round numbers, a price sheet in round numbers; each lever's machine
cost, revenue and time to first token as the arithmetic says. And `carpool bench ledger-replay`, which sends the
same rows to a real server to hold the predictions against: the shared prefix is shared again there."""

import json
import os
import statistics

import pytest
from live_server import LiveServer

from carpool.bench import ledger_replay, whatif
from carpool.bench.serve import latency_summary
from carpool.bench.simulate import ReplicaSpec, StepModel, replay
from carpool.cli import build_parser
from carpool.economics.contract import block_chain_text
from carpool.economics.db import open_database

SHEET = """
[cache]
read = 0.1
write = 1.25
[models.m]
input = 1.0
output = 2.0
"""
STEP = "0.01,0.001,0.01"  # 10 ms a step, 1 ms a prompt token, 10 ms a decoding sequence


def ledger(path, rows, tiers=(), ttfts=()) -> None:
    conn = open_database(path)
    with conn:
        for i, (arrived, tenant, prompt_tokens, chain) in enumerate(rows):
            conn.execute(
                "INSERT INTO ledger (time, tenant, model, tier, uncached_prompt_tokens, cache_read_tokens,"
                " cache_write_tokens, output_tokens, queue_seconds, prefill_seconds, decode_seconds, finish_reason,"
                " cost, arrived, prompt_block_chain) VALUES (?, ?, 'm', ?, ?, 0, 0, 2, 0, ?, 0, 'stop', 1, ?, ?)",
                (
                    1000 + (arrived or 0),
                    tenant,
                    tiers[i] if i < len(tiers) else "default",
                    prompt_tokens,
                    ttfts[i] if i < len(ttfts) else 0.0,
                    None if arrived is None else 1000 + arrived,
                    block_chain_text([chain]),
                ),
            )
    conn.close()


def test_each_lever_costs_and_bills_what_the_arithmetic_says(tmp_path):
    shared = [f"block-{i}".encode().ljust(8, b".") for i in range(4)]
    other = [f"other-{i}".encode().ljust(8, b".") for i in range(2)]
    ledger(
        tmp_path / "carpool.db",
        [(0, "a", 64, shared), (100, "a", 64, shared), (200, "b", 32, other), (None, "a", 64, shared)],
    )
    (tmp_path / "prices.toml").write_text(SHEET)
    out = tmp_path / "whatif.json"
    args = build_parser().parse_args(
        ["cost", "whatif", "--db", str(tmp_path / "carpool.db"), "--hourly-price", "3.6", "--step", STEP]
        + ["--prices", str(tmp_path / "prices.toml"), "--replicas", "2", "--batch-tenants", "b", "--out", str(out)]
    )
    assert whatif.main(args) == 0
    report = json.loads(out.read_text())
    assert (report["rows"], report["left_out"]) == (3, 1)  # the row without an arrival time cannot be replayed
    assert report["ledger_revenue"] == 3  # the synthetic rows' cost column, $1 each
    by_name = {row["scenario"]: row for row in report["scenarios"]}
    today = by_name["today"]
    # The last request arrives at 200 s and runs a 32-token prefill (42 ms) and one decode step (20 ms).
    assert today["seconds"] == pytest.approx(200.062)
    assert today["machine_cost"] == pytest.approx(3.6 * 200.062 / 3600)
    # $ per 1M: the first writes its 64 tokens' blocks to the cache at 1.25, + 2 x 2 out; the second reads 63
    # cached tokens at 0.1 (its last is computed): 1 + 6.3 + 4; the third writes 32 at 1.25, + 4.
    assert today["revenue"] == pytest.approx((84 + 11.3 + 44) / 1e6)
    assert today["latency"]["default"]["ttft_p50_s"] == pytest.approx(0.042)  # of 74, 11 and 42 ms
    assert by_name["no prefix cache"]["revenue"] == pytest.approx((68 + 68 + 36) / 1e6)
    moved = by_name["Batch API (1 moved)"]
    assert moved["revenue"] == pytest.approx((84 + 11.3 + 22) / 1e6) and moved["batch_within_window"]
    assert set(moved["latency"]) == {"default", "batch"}
    assert by_name["2 replicas"]["machine_cost"] == pytest.approx(2 * today["machine_cost"])
    assert by_name["Batch API + 2 replicas"]["margin_change"] == pytest.approx(
        moved["revenue"] - today["revenue"] - today["machine_cost"]
    )
    assert out.with_suffix(".png").exists()


def test_compression_replays_the_scorers_pass_then_the_cut_prompt_behind_its_kept_shared_prefix(tmp_path):
    shared = [f"block-{i}".encode().ljust(8, b".") for i in range(4)]
    own = [[f"{name}-{i}".encode().ljust(8, b".") for i in range(4)] for name in ("a", "b")]
    other = [f"other-{i}".encode().ljust(8, b".") for i in range(2)]
    ledger(
        tmp_path / "carpool.db",
        [(0, "a", 128, shared + own[0]), (100, "a", 128, shared + own[1]), (200, "b", 32, other)],
    )
    (tmp_path / "prices.toml").write_text(SHEET)
    out = tmp_path / "whatif.json"
    args = build_parser().parse_args(
        ["cost", "whatif", "--db", str(tmp_path / "carpool.db"), "--hourly-price", "3.6", "--step", STEP]
        + ["--prices", str(tmp_path / "prices.toml"), "--compress-rate", "0.5", "--compress-min-tokens", "100"]
        + ["--out", str(out)]
    )
    assert whatif.main(args) == 0
    compressed = {row["scenario"]: row for row in json.loads(out.read_text())["scenarios"]}["compress to 0.5 (2)"]
    # The first: its scorer computes all 128 tokens (138 ms), then its request keeps the 64 shared tokens (a hit
    # now) and half of the other 64: 32 computed (42 ms), first token at 180 ms. The second's scorer reads the
    # shared 64 and computes 64 (74 ms); its request is again 32 computed over 64 cached: 116 ms. The third, 32
    # tokens under the minimum, is not compressed: 42 ms.
    assert compressed["latency"]["default"]["ttft_p50_s"] == pytest.approx(0.116)
    assert compressed["prompt_tokens_computed"] == 128 + 32 + 64 + 32 + 32
    # Billed per 1M, every block a prompt adds to the cache written at 1.25: the scorers 128 x 1.25 + 1 x 2 out and
    # 64 x 1.25 + 6.4 cached + 2; each request 32 x 1.25 + 6.4 + 2 x 2; the third 32 x 1.25 + 4.
    assert compressed["revenue"] == pytest.approx((162 + 88.4 + 2 * 50.4 + 44) / 1e6)
    assert compressed["seconds"] == pytest.approx(200.062)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["cost", "whatif", "--hourly-price", "1", "--compress-rate", "1.5"])


def test_a_breakpoint_keeps_its_shared_prefix_through_an_eviction_and_bills_its_writes_at_the_ttls_rate(tmp_path):
    shared = [f"block-{i}".encode().ljust(8, b".") for i in range(4)]
    own = {name: [f"{name}-{i}".encode().ljust(8, b".") for i in range(8)] for name in "abc"}
    rows = [(0, "t", 96, shared + own["a"][:2]), (10, "t", 128, own["b"]), (20, "t", 96, shared + own["c"][:2])]
    ledger(tmp_path / "carpool.db", rows)
    (tmp_path / "prices.toml").write_text(
        SHEET.replace("write = 1.25", "write = 1.25\nwrite_1h = 2.0\nmin_tokens = 64")
    )
    out = tmp_path / "whatif.json"
    args = build_parser().parse_args(
        ["cost", "whatif", "--db", str(tmp_path / "carpool.db"), "--hourly-price", "3.6", "--step", STEP]
        + ["--prices", str(tmp_path / "prices.toml"), "--num-kv-blocks", "8", "--out", str(out)]
        + ["--breakpoint-ttl", "5m", "--breakpoint-ttl", "1h"]
    )
    assert whatif.main(args) == 0
    by_name = {row["scenario"]: row for row in json.loads(out.read_text())["scenarios"]}
    today, five, hour = by_name["today"], by_name["breakpoints 5m"], by_name["breakpoints 1h"]
    # An 8-block pool: the second prompt's 8 blocks evict the first's 6, so the third misses today (96 tokens,
    # 106 ms); pinned, the shared 4 blocks stay and the third computes 32 tokens (42 ms).
    assert [today["hit_rate"], five["hit_rate"]] == [0.0, pytest.approx(64 / 320)]
    assert [today["prompt_tokens_computed"], five["prompt_tokens_computed"]] == [320, 256]
    # Per 1M, writes at 1.25 (automatic and 5-minute) or 2.0 (1-hour): today 96 + 128 + 96 written, + 2 x 3 x 2 out;
    # pinned, the third reads 64 at 0.1 and writes 32; under 1 hour the first's 64 pinned tokens are written at 2.0.
    assert today["revenue"] == pytest.approx((320 * 1.25 + 12) / 1e6)
    assert five["revenue"] == pytest.approx(((96 + 128 + 32) * 1.25 + 6.4 + 12) / 1e6)
    assert hour["revenue"] == pytest.approx(((32 + 128 + 32) * 1.25 + 64 * 2.0 + 6.4 + 12) / 1e6)


def test_a_router_and_a_cascade_run_their_rows_on_the_cheaper_models_replica_and_bill_each_attempt(tmp_path):
    shared = [f"block-{i}".encode().ljust(8, b".") for i in range(4)]
    other = [f"other-{i}".encode().ljust(8, b".") for i in range(2)]
    ledger(tmp_path / "carpool.db", [(0, "a", 64, shared), (100, "a", 64, shared), (200, "b", 32, other)])
    (tmp_path / "prices.toml").write_text(SHEET + "[models.small]\ninput = 0.5\noutput = 1.0\n")
    out = tmp_path / "whatif.json"
    args = build_parser().parse_args(
        ["cost", "whatif", "--db", str(tmp_path / "carpool.db"), "--hourly-price", "3.6", "--step", STEP]
        + ["--prices", str(tmp_path / "prices.toml"), "--router", "small:1", "--cascade", "small:1"]
        + ["--cheap-step", "0.005,0.0005,0.005", "--out", str(out)]
    )
    assert whatif.main(args) == 0
    by_name = {row["scenario"]: row for row in json.loads(out.read_text())["scenarios"]}
    routed, cascade = by_name["router to small (3)"], by_name["cascade via small (3 escalated)"]
    # Every row on the cheap model (5 ms a step, 0.5 ms a prompt token): first tokens at 37, 5.5 (63 cached) and
    # 21 ms; billed at its prices; two machines (the recorded model's replica idles).
    assert routed["replicas"] == 2 and routed["machine_cost"] == pytest.approx(2 * 3.6 * 200.031 / 3600)
    assert routed["latency"]["default"]["ttft_p50_s"] == pytest.approx(0.021)
    assert routed["revenue"] == pytest.approx((42 + 5.65 + 22) / 1e6)
    # Escalated, each row waits for its cheap attempt (37 + 10, 5.5 + 10, 21 + 10 ms), then the recorded model's
    # first token (74, 11, 42 ms): 121, 26.5 and 73 ms; both attempts billed.
    assert cascade["latency"]["default"]["ttft_p50_s"] == pytest.approx(0.073)
    assert cascade["revenue"] == pytest.approx((42 + 5.65 + 22 + 84 + 11.3 + 44) / 1e6)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["cost", "whatif", "--hourly-price", "1", "--router", "small:2"])


def test_the_time_to_first_token_no_step_explains_is_fitted_to_the_recorded_rows_and_delays_every_scenario(tmp_path):
    shared = [f"block-{i}".encode().ljust(8, b".") for i in range(4)]
    other = [f"other-{i}".encode().ljust(8, b".") for i in range(2)]
    # Today's replay gives them 74, 11 and 42 ms; the ledger recorded each 30 ms later.
    rows = [(0, "a", 64, shared), (100, "a", 64, shared), (200, "b", 32, other)]
    ledger(tmp_path / "carpool.db", rows, ttfts=(0.104, 0.041, 0.072))
    (tmp_path / "prices.toml").write_text(SHEET)
    out = tmp_path / "whatif.json"
    args = build_parser().parse_args(
        ["cost", "whatif", "--db", str(tmp_path / "carpool.db"), "--hourly-price", "3.6", "--step", STEP]
        + ["--prices", str(tmp_path / "prices.toml"), "--out", str(out)]
    )
    assert whatif.main(args) == 0
    report = json.loads(out.read_text())
    assert report["admission_s"] == pytest.approx(0.030)
    by_name = {row["scenario"]: row for row in report["scenarios"]}
    assert by_name["today"]["latency"]["default"]["ttft_p50_s"] == pytest.approx(0.042 + 0.030)
    assert by_name["no prefix cache"]["latency"]["default"]["ttft_p50_s"] == pytest.approx(0.074 + 0.030)


def test_steps_of_another_token_budget_chunk_the_prompt_as_the_engine_would(tmp_path):
    ledger(tmp_path / "carpool.db", [(0, "a", 64, [f"block-{i}".encode().ljust(8, b".") for i in range(4)])])
    (tmp_path / "prices.toml").write_text(SHEET)
    out = tmp_path / "whatif.json"
    args = build_parser().parse_args(
        ["cost", "whatif", "--db", str(tmp_path / "carpool.db"), "--hourly-price", "3.6", "--step", STEP]
        + ["--prices", str(tmp_path / "prices.toml"), "--step-tokens", "32,512", "--out", str(out)]
    )
    assert whatif.main(args) == 0
    by_name = {row["scenario"]: row for row in json.loads(out.read_text())["scenarios"]}
    assert set(by_name) == {"today", "no prefix cache", "steps of 32 tokens"}  # 512 is today's budget
    # Today the 64-token prompt is one 74 ms step; at 32 tokens a step, two of 42 ms. Its one decode: 20 ms.
    assert by_name["today"]["latency"]["default"]["ttft_p50_s"] == pytest.approx(0.074)
    small = by_name["steps of 32 tokens"]
    assert small["latency"]["default"]["ttft_p50_s"] == pytest.approx(0.084)
    assert small["latency"]["default"]["itl_p50_s"] == pytest.approx(0.020)
    assert small["seconds"] == pytest.approx(0.104)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["cost", "whatif", "--hourly-price", "1", "--step-tokens", "0"])


def test_each_scenario_is_the_median_of_its_draws_of_the_steps_spread(tmp_path):
    """With a spread around the step model, each draw is another day's step times: the report's latencies are the
    draws' medians of their own percentiles and its span the draws' mean, not one draw's."""
    rows = [(0.05 * i, "a", 48, [f"row-{i}-{b}".encode().ljust(8, b".") for b in range(3)]) for i in range(6)]
    ledger(tmp_path / "carpool.db", rows)
    (tmp_path / "prices.toml").write_text(SHEET)
    out = tmp_path / "whatif.json"
    noisy = "0.01,0.001,0.01,0,0,0,0.5"
    args = build_parser().parse_args(
        ["cost", "whatif", "--db", str(tmp_path / "carpool.db"), "--hourly-price", "3.6", "--step", noisy]
        + ["--prices", str(tmp_path / "prices.toml"), "--draws", "3", "--out", str(out)]
    )
    assert whatif.main(args) == 0
    today = json.loads(out.read_text())["scenarios"][0]
    recorded, _ = whatif.recorded_rows(str(tmp_path / "carpool.db"), None, None, None)
    jobs, _ = whatif.scenario_jobs(whatif.Scenario("today", 1), recorded, 16, 0)
    step, spec = StepModel.parse(noisy), ReplicaSpec()
    draws = [replay(jobs, 1, "prefix", step, spec, draw=draw) for draw in range(3)]
    assert len({tuple(result.ttft) for result in draws}) == 3  # three draws, not one three times
    summaries = [latency_summary(r.ttft, r.itl) for r in draws]
    assert today["latency"]["default"] == pytest.approx(
        {k: statistics.median(s[k] for s in summaries) for k in summaries[0]}
    )
    assert today["seconds"] == pytest.approx(sum(r.makespan for r in draws) / 3)
    with pytest.raises(ValueError, match="--draws"):
        whatif.main(build_parser().parse_args(["cost", "whatif", "--hourly-price", "1", "--draws", "0"]))


def test_the_step_model_of_the_default_servers_rows_is_fitted_on_the_default_model():
    """`carpool serve` without --model serves the embedded GGUF under its file's stem, which is no catalog name: the
    fit would fail to find a model to load."""
    assert whatif.fit_target("SmolLM2-135M-Instruct.Q4_1") == "smollm2-135m"
    assert whatif.fit_target("qwen2.5-coder-0.5b") == "qwen2.5-coder-0.5b"


def test_a_ledger_without_replayable_rows_is_one_line_naming_it(tmp_path):
    ledger(tmp_path / "carpool.db", [(None, "a", 64, [])])
    args = build_parser().parse_args(
        ["cost", "whatif", "--db", str(tmp_path / "carpool.db"), "--hourly-price", "1", "--step", STEP]
    )
    with pytest.raises(ValueError, match="no row in that window has an arrival time"):
        whatif.main(args)


def test_the_replay_sends_the_recorded_traffic_so_a_shared_prefix_is_a_cache_hit_again(tmp_path):
    shared = [f"block-{i}".encode().ljust(8, b".") for i in range(4)]
    other = [f"other-{i}".encode().ljust(8, b".") for i in range(2)]
    rows = [(0, "a", 64, shared), (1, "a", 64, shared), (2, "b", 40, other), (3, "a", 64, shared)]
    ledger(tmp_path / "carpool.db", rows, tiers=("default", "default", "flex", "batch"))
    server = LiveServer()
    try:
        args = build_parser().parse_args(
            ["bench", "ledger-replay", "--url", server.url, "--db", str(tmp_path / "carpool.db"), "--speed", "4"]
            + ["--out", str(tmp_path / "replay.json"), "--server-db", os.path.join(server.home, "carpool.db")]
        )
        assert ledger_replay.main(args) == 0
    finally:
        server.stop()
    report = json.loads((tmp_path / "replay.json").read_text())
    assert (report["requests"], report["errors"], report["batch_rows_left_out"]) == (3, 0, 1)
    # The second request reads the first's 4 blocks but its last token: 63 of the 64 + 64 + 40 prompt tokens.
    assert report["hit_rate"] == pytest.approx(63 / 168)
    assert set(report["latency"]) == {"default", "flex"} and report["latency"]["flex"]["itl_p50_s"] > 0
    # The server's own time to first token, from its ledger's rows of this replay: within the client's.
    server_side = report["server_latency"]
    assert set(server_side) == {"default", "flex"}
    for tier, client in report["latency"].items():
        assert 0 < server_side[tier]["ttft_p50_s"] <= client["ttft_p50_s"]


def test_a_comparison_reads_the_servers_ttft_and_holds_p50s_to_15_and_p99s_to_30_percent():
    predicted = {
        "seconds": 100.0,
        "hit_rate": 0.5,
        "latency": {"priority": {"ttft_p50_s": 0.060, "ttft_p99_s": 0.5, "itl_p50_s": 0.012, "itl_p99_s": None}},
    }
    real = {
        "seconds": 110.0,
        "hit_rate": 0.5,
        "latency": {"priority": {"ttft_p50_s": 0.080, "ttft_p99_s": 0.9, "itl_p50_s": 0.010, "itl_p99_s": 0.2}},
        "server_latency": {"priority": {"ttft_p50_s": 0.066, "ttft_p99_s": 0.4}},
    }
    rows = ledger_replay.compare(predicted, real)
    assert rows["seconds"]["error"] == pytest.approx(100 / 110 - 1) and rows["seconds"]["held"]
    # TTFT against the server's own (what the whatif predicts), not the client's 80 ms.
    assert rows["priority ttft_p50_s"]["real"] == 0.066 and rows["priority ttft_p50_s"]["held"]
    assert rows["priority ttft_p99_s"]["error"] == pytest.approx(0.25) and rows["priority ttft_p99_s"]["held"]
    assert rows["priority itl_p50_s"]["error"] == pytest.approx(0.2) and not rows["priority itl_p50_s"]["held"]
    assert "priority itl_p99_s" not in rows  # nothing predicted


def test_a_saved_replay_report_is_held_against_a_prediction_without_sending_anything(tmp_path, capsys):
    """`ledger-replay --compare W:S --report R`: an earlier run's report against a (new) prediction, so a change
    to the simulator is judged on the same real runs."""
    latency = {"ttft_p50_s": 0.060, "ttft_p99_s": 0.5, "itl_p50_s": 0.012, "itl_p99_s": 0.1}
    prediction = {
        "scenarios": [{"scenario": "today", "seconds": 100.0, "hit_rate": 0.5, "latency": {"default": latency}}]
    }
    (tmp_path / "whatif.json").write_text(json.dumps(prediction))
    real = {"seconds": 100.0, "hit_rate": 0.5, "latency": {"default": latency | {"itl_p50_s": 0.010}}}
    (tmp_path / "real.json").write_text(json.dumps(real))
    compare = ["bench", "ledger-replay", "--compare", f"{tmp_path / 'whatif.json'}:today"]
    assert ledger_replay.main(build_parser().parse_args(compare + ["--report", str(tmp_path / "real.json")])) == 0
    printed = {line.split()[0] + " " + line.split()[1]: line for line in capsys.readouterr().out.splitlines()}
    assert "+20%" in printed["default itl_p50_s"] and "held" not in printed["default itl_p50_s"]
    assert printed["default ttft_p50_s"].endswith("held")
    with pytest.raises(ValueError, match="--compare"):
        ledger_replay.main(build_parser().parse_args(["bench", "ledger-replay", "--report", "real.json"]))
    with pytest.raises(ValueError, match="--url and --db"):
        ledger_replay.main(build_parser().parse_args(compare))
