"""`carpool bench trace` without servers: the serve flags it starts, the metrics it reads, the per-slice figures
and the plot."""

import argparse
import json
from pathlib import Path

import pytest
from prometheus_client import generate_latest

from carpool.bench.trace import (
    Configuration,
    compare,
    configurations,
    format_slice,
    metric_values,
    parse_users,
    plot,
    slice_reports,
    summarize,
)
from carpool.bench.trace_replicas import write_plan
from carpool.cli import build_parser
from carpool.engine.llm_engine import StepStats
from carpool.engine.slo import StepLimits
from carpool.server.assembly import model_configs
from carpool.server.metrics import ServerMetrics


def bench_args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["bench", "trace", *argv])


def test_the_three_servers_get_serve_flags_that_configure_what_they_claim():
    configs = configurations(bench_args("--slo-itl-ms", "80", "--small", "32:8", "--large", "512:64"))
    assert [c.name for c in configs] == ["slo", "fixed-32", "fixed-512"]
    engines = [
        next(iter(model_configs(build_parser().parse_args(["serve", *c.serve_flags])).values())) for c in configs
    ]
    assert [(e.max_num_batched_tokens, e.max_num_seqs, e.slo_itl_ms) for e in engines] == [
        (512, 64, {"priority": 80.0}),
        (32, 8, {}),
        (512, 64, {}),
    ]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--small", "32"], "--small: expected TOKENS:SEQS"),
        (["--large", "0:8"], "--large: expected TOKENS:SEQS"),
        (["--url", "http://x"], "--url: expected NAME=URL"),
        (["--slo-itl-ms", "0"], "--slo-itl-ms must be > 0"),
    ],
)
def test_bad_flags_are_refused_naming_the_flag(argv, message):
    with pytest.raises(ValueError, match=message):
        configurations(bench_args(*argv))


def test_bad_user_counts_are_refused():
    assert parse_users("1,4,0") == [1, 4, 0]
    for text in ("1,x", "-1,2"):
        with pytest.raises(ValueError, match="--users"):
            parse_users(text)


def test_it_reads_the_servers_token_counters_and_step_budget():
    metrics = ServerMetrics(["m"])
    metrics.generation_tokens.labels("m", "priority").inc(30)
    metrics.generation_tokens.labels("m", "batch").inc(70)
    limits = StepLimits(96, 12, "itl", "priority", target_factor=0.75, itl_p99=0.092)
    metrics.models["m"].on_step(StepStats(8, 2, 0, 8, 0, duration=0.01, limits=limits), [])
    values = metric_values(generate_latest(metrics.registry).decode())
    assert values == {
        "tokens": 100.0,
        "priority_tokens": 30.0,
        "step_token_budget": 96.0,
        "step_itl_p99_seconds": 0.092,
        "step_target_factor": 0.75,
        "replicas": None,  # a server without replicas
    }


def test_each_slice_gets_its_own_itl_p99_throughput_and_cost():
    controller = {"step_itl_p99_seconds": 0.090, "step_target_factor": 0.8}
    samples = [
        (0.0, {"tokens": 0, "priority_tokens": 0, "step_token_budget": 64, **controller}),
        (
            5.0,
            {
                "tokens": 500,
                "priority_tokens": 200,
                "step_token_budget": 64,
                **controller,
                "step_itl_p99_seconds": 0.110,
                "step_target_factor": 0.6,
            },
        ),
        (10.0, {"tokens": 1000, "priority_tokens": 400, "step_token_budget": 32}),
        (20.0, {"tokens": 3000, "priority_tokens": 400, "step_token_budget": 512}),
    ]
    gaps = [(1.0 + i / 100, 0.040) for i in range(97)] + [(5.0, 0.300)] * 3 + [(12.0, 0.020)]
    first, second = slice_reports([4, 0], 10.0, gaps, samples, slo_ms=100, hourly_price=0.36)
    assert first.itl_p99_ms == pytest.approx(300) and first.itl_p50_ms == pytest.approx(40)
    assert first.within_slo is False and second.within_slo is True
    assert (first.output_tokens_per_s, first.priority_tokens_per_s) == (100.0, 40.0)
    assert second.output_tokens_per_s == 200.0
    assert first.cost_per_1m_tokens == pytest.approx(0.36 / 3600 / 100 * 1e6)  # $1 per 1M at 100 tok/s
    assert first.mean_step_token_budget == 64 and second.mean_step_token_budget == 32
    # The controller's own view, next to the client's: its window p99 and target factor, averaged per slice.
    assert (first.engine_itl_p99_ms, first.mean_target_factor) == (pytest.approx(100), pytest.approx(0.7))
    assert (second.engine_itl_p99_ms, second.mean_target_factor) == (None, None)  # a server without them
    summary = summarize([first, second], 10.0)
    assert (summary["peak_slices"], summary["peak_slices_within_slo"]) == (1, 0)
    assert summary["mean_output_tokens_per_s"] == 150.0
    assert summary["replica_seconds"] is None  # a server without replicas


def test_throughput_is_compared_with_the_best_fixed_configuration_and_each_gets_a_plot(tmp_path):
    samples = [
        (0.0, {"tokens": 0, "priority_tokens": 0, "step_token_budget": None}),
        (10.0, {"tokens": 500, "priority_tokens": 100, "step_token_budget": None}),
    ]
    runs = []
    for name, gap in (("slo", 0.05), ("fixed-32", 0.04), ("fixed-512", 0.4)):
        slices = slice_reports([2], 10.0, [(1.0, gap)], samples, slo_ms=100, hourly_price=0.1)
        runs.append(
            {
                "name": name,
                "serve_flags": [],
                "url": Configuration(name).url,
                "slices": [vars(s) for s in slices],
                "summary": summarize(slices, 10.0),
            }
        )
    runs[1]["summary"]["mean_output_tokens_per_s"] = 25.0
    compare(runs)
    assert runs[0]["summary"]["throughput_vs_best_other"] == 1.0  # best fixed: fixed-512's 50 tok/s
    assert runs[1]["summary"]["throughput_vs_best_other"] == 0.5
    runs[0]["slices"][0]["engine_itl_p99_ms"] = 45.0  # the SLO controller's own p99 is drawn too
    report = {"slice_seconds": 10.0, "slo_itl_ms": 100.0, "users": [2]}
    plot(runs[0], report, runs, tmp_path / "trace-slo.png")
    assert (tmp_path / "trace-slo.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def serve_config(flags: list[str]):
    args = build_parser().parse_args(["serve", *flags])
    return args, next(iter(model_configs(args).values()))


def test_replicas_mode_starts_fixed_min_fixed_max_autoscaled_and_prewarmed_one_thread_replicas_under_the_slo():
    configs = configurations(bench_args("--replicas", "1:3", "--slo-itl-ms", "80", "--scale-down-delay", "10"))
    assert [c.name for c in configs] == ["fixed-1", "fixed-3", "autoscaled", "prewarmed"]
    served = [serve_config(c.serve_flags) for c in configs]
    assert [str(args.replicas) for args, _ in served] == ["1", "3", "1:3", "1:3"]
    assert all((e.num_threads, e.slo_itl_ms, e.max_num_seqs) == (1, {"priority": 80.0}, 64) for _, e in served)
    assert [args.scale_down_delay for args, _ in served[2:]] == [10.0, 10.0]
    prewarmed = configs[3]
    assert (prewarmed.plan_from, served[3][0].capacity_plan) == ("autoscaled", prewarmed.plan_path)
    assert json.loads(Path(prewarmed.plan_path).read_text()) == {"minutes": []}  # serve checks it before starting
    assert served[2][0].capacity_plan is None
    for argv, message in (
        (["--replicas", "2"], "expected MIN:MAX with MIN < MAX"),
        (["--replicas", "1:2", "--url", "a=http://x"], "give one of them"),
        (["--config", "fast"], "--config: expected NAME=FLAGS"),
        (["--slo-ttft-ms", "-5"], "--slo-ttft-ms must be > 0"),
    ):
        with pytest.raises(ValueError, match=message):
            configurations(bench_args(*argv))


def test_config_flags_start_servers_with_the_flags_given():
    (config,) = configurations(bench_args("--config", "small=--max-num-seqs 8 --slo-itl-ms priority=50"))
    assert (config.name, serve_config(config.serve_flags)[1].max_num_seqs) == ("small", 8)


def test_the_prewarm_plan_is_the_autoscaled_runs_replicas_per_slice_started_ahead_on_the_runs_clock(tmp_path):
    from carpool.server.replicas.autoscaling import plan_floor, read_plan

    yesterday = [{"index": 0, "replicas": 1.0}, {"index": 1, "replicas": 1.4}, {"index": 2, "replicas": 2.0}]
    path = tmp_path / "plan.json"
    args = bench_args("--replicas", "1:2", "--slice-seconds", "20", "--replica-start-seconds", "12")
    write_plan(str(path), yesterday, 1000.0, args)
    plan = read_plan(str(path))  # what `carpool serve --capacity-plan` reads, whole
    assert [m["replicas"] for m in plan["minutes"]] == [1, 2, 2]  # a second replica served part of slice 1
    assert plan_floor(plan, 1000.0 + 7.9) == 1 and plan_floor(plan, 1000.0 + 8.0) == 2  # 12 s before slice 1
    assert plan_floor(plan, 1000.0 + 60.0) == 0  # past the day: the autoscaler's own answer


def test_each_slice_gets_its_ttft_and_serving_replicas_and_the_run_its_replica_seconds():
    sample = metric_values("")
    samples = [(at, {**sample, "tokens": 10 * at, "replicas": n}) for at, n in ((0.0, 1.0), (5.0, 2.0), (10.0, 2.0))]
    gaps = [(1.0, 0.05), (11.0, 0.05)]
    ttfts = [(1.0, 0.2)] * 98 + [(2.0, 3.0)] * 2 + [(11.0, 0.5)]
    first, second = slice_reports([4, 4], 10.0, gaps, samples, 100, 0.1, ttfts, slo_ttft_ms=1000)
    assert (first.ttft_p50_ms, second.ttft_p99_ms) == (pytest.approx(200), pytest.approx(500))
    assert first.itl_p99_ms < 100 and first.ttft_p99_ms > 1000 and first.within_slo is False  # TTFT missed
    assert second.within_slo is True
    assert (first.replicas, second.replicas) == (1.5, 2.0)
    assert summarize([first, second], 10.0)["replica_seconds"] == 35.0
    text = "\n".join(format_slice(s) for s in (first, second))
    assert "replicas 1.50" in text and "missed" in text


def test_it_sums_the_serving_replicas_of_every_model():
    text = 'carpool:replicas{model_name="a"} 2.0\ncarpool:replicas{model_name="b"} 1.0\n'
    assert metric_values(text)["replicas"] == 3.0


def test_the_batch_job_slice_is_checked_before_any_server_starts():
    args = bench_args("--users", "2,10,0", "--batch-at", "3", "--config", "a=--max-num-seqs 8")
    with pytest.raises(ValueError, match="--batch-at: a slice of the trace, 0 to 2, got 3"):
        args.func(args)
