"""`carpool bench trace` without servers: the serve flags it starts, the metrics it reads, the per-slice figures
and the plot."""

import argparse

import pytest
from prometheus_client import generate_latest

from carpool.bench.trace import (
    Configuration,
    compare,
    configurations,
    metric_values,
    parse_users,
    plot,
    slice_reports,
    summarize,
)
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
    summary = summarize([first, second])
    assert (summary["peak_slices"], summary["peak_slices_within_slo"]) == (1, 0)
    assert summary["mean_output_tokens_per_s"] == 150.0


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
                "summary": summarize(slices),
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
