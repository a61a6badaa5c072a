"""The compressed day on a changing replica set (`carpool bench simulate --day`): Ray's delays and start time around
carpool's policy, drained replicas that finish their requests, the SLO-sized target, and the pre-warm plan meeting
the SLO where the reactive autoscaler misses it. A hand step model, no model load: a step of N decoding priority
streams takes 20 + 4N ms (plus 0.1 ms a prompt token), so one replica misses a 100 ms ITL SLO with 30 users
(140 ms steps) and two meet it (15 each: ~80 ms); a replica reports a live capacity of ~16 streams in the peak,
far below its 64 slots."""

import json
import random

import pytest

from carpool.bench.simulate import ReplicaSpec, StepModel
from carpool.bench.simulate_day import (
    DayTraffic,
    Scaling,
    configurations,
    plan_from,
    power_of_two,
    run_configurations,
    run_day,
)

STEP = StepModel(base=0.020, per_prefill_token=0.0001, per_decode_seq=0.004)
SLO = ReplicaSpec(slo_itl_ms={"priority": 100.0})
# 10 s slices: 6 users, a 30-user peak of two slices, 6 again.
DAY = DayTraffic(users=(6, 30, 30, 6, 6), slice_seconds=10.0, prompts=(32, 48, 40), chat_max_tokens=16)


def autoscaled(**overrides) -> Scaling:
    return Scaling("auto", 1, 2, **{"replica_start_seconds": 5.0, "downscale_delay_s": 5.0, **overrides})


def test_a_peak_scales_up_after_the_upscale_delay_and_the_start_time_and_down_after_the_downscale_delay():
    day = run_day(DAY, autoscaled(), STEP, SLO)
    assert len(day.lives) == 2
    first, added = day.lives
    assert first.up == 0.0 and first.removed is None
    # The peak begins at 10 s; the 5 s window's mean passes one replica's capacity within it, then Ray waits 2 s
    # (the capacity is said once a replica has run CAPACITY_MIN_STEPS steps: about 15 s of this day's).
    assert 10.0 + 2.0 <= added.decided <= 10.0 + 5.0 + 2.0 + 3.0
    assert added.up == pytest.approx(added.decided + 5.0)  # it takes traffic only once started
    # The peak ends at 30 s: down after the 5 s downscale delay, the newest replica first.
    assert 30.0 + 5.0 <= added.removed <= 30.0 + 5.0 + 5.0 + 1.0
    assert day.decisions == [(added.decided, 2), (added.removed, 1)]
    # The delays are Ray's: the same day without them decides exactly that much earlier.
    eager = run_day(DAY, autoscaled(upscale_delay_s=0.0, downscale_delay_s=0.0), STEP, SLO)
    assert eager.lives[1].decided == pytest.approx(added.decided - 2.0)
    slower = run_day(DAY, autoscaled(downscale_delay_s=8.0), STEP, SLO)
    assert slower.lives[1].removed == pytest.approx(added.removed + 3.0)


def test_a_drained_replica_finishes_what_it_holds_and_no_request_is_lost():
    day = run_day(DAY, autoscaled(), STEP, SLO)
    drained = day.lives[1]
    assert drained.held_at_removal > 0  # it was serving users when it was removed
    assert drained.removed < drained.stopped < DAY.seconds  # it stopped once they had finished
    # It cost until it stopped, not until it was removed.
    assert day.replica_seconds(0.0, DAY.seconds) == pytest.approx(DAY.seconds + drained.stopped - drained.decided)
    # Every request sent finished, but those still running when the day ended (on the replica that stayed).
    assert day.sent == day.finished + day.held
    assert day.held <= DAY.users[-1]


def test_the_autoscaler_sizes_replicas_by_live_capacity_under_an_itl_slo_not_by_slots():
    with_slo = run_day(DAY, autoscaled(), STEP, SLO)
    assert max(target for _, target in with_slo.decisions) == 2
    # The same day without an ITL SLO: 30 streams fill under half of one replica's 64 slots, one replica stays.
    slots = run_day(DAY, autoscaled(), STEP, ReplicaSpec())
    assert slots.decisions == [] and len(slots.lives) == 1


def test_pre_warming_meets_the_slo_in_the_peaks_first_slice_where_the_reactive_autoscaler_misses_it():
    runs = run_configurations(DAY, configurations(1, 2, 5.0, 5.0), STEP, SLO)
    reports = {run.scaling.name: run.report(100.0, 2000.0, 0.10) for run in runs}
    fixed_min, fixed_max = reports["fixed-1"], reports["fixed-2"]
    reactive, planned = reports["autoscaled-1:2"], reports["autoscaled-1:2+plan"]
    peak = 1
    assert fixed_min["slices"][peak]["within_slo"] is False  # one replica cannot carry the peak
    assert fixed_max["slices"][peak]["within_slo"] is True  # two can
    assert reactive["slices"][peak]["within_slo"] is False  # the second one came too late
    assert planned["slices"][peak]["within_slo"] is True  # the plan had it up when the peak began
    assert planned["slices"][peak]["serving_replicas"] == pytest.approx(2.0)
    # Both autoscaled runs cost less than fixed MAX; the plan's lead costs a little more than reacting.
    assert reactive["replica_minutes"] < planned["replica_minutes"] < fixed_max["replica_minutes"]
    assert fixed_max["replica_minutes"] == pytest.approx(2 * DAY.seconds / 60)
    assert fixed_max["usd"] == pytest.approx(2 * DAY.seconds / 3600 * 0.10)
    # The plan is yesterday's reactive day: its most replicas serving each slice, raised ahead by the start time
    # (the policy reads the floor Ray's upscale delay and a tick further ahead).
    plan = runs[-1].scaling.plan
    assert plan == plan_from(runs[2], 5.0)
    assert [minute["replicas"] for minute in plan["minutes"]] == [1, 2, 2, 2, 1]
    assert plan["minute_seconds"] == 10.0


def test_batch_lines_fill_the_slots_the_batch_api_allows_and_are_counted_when_done():
    # The Batch API keeps as many lines in flight as the router has slots: MAX replicas' (here 2 x 4).
    traffic = DayTraffic(users=(2, 0), slice_seconds=10.0, prompts=(32,), chat_max_tokens=16, batch_lines=500)
    spec = ReplicaSpec(max_num_seqs=4, slo_itl_ms={"priority": 100.0})
    day = run_day(traffic, Scaling("auto", 1, 2), STEP, spec)
    report = day.report(100.0, 2000.0, 0.10)
    assert 0 < report["batch_lines_completed"] < 500
    assert day.held == day.sent - day.finished == 8  # the users have left; 8 lines are in flight to the end


def test_power_of_two_choices_takes_the_less_loaded_of_two():
    ongoing = [5, 0, 9]
    rng = random.Random(0)
    picks = {power_of_two([0, 1, 2], ongoing, rng) for _ in range(50)}
    assert picks == {0, 1}  # never the most loaded replica: it loses to either other one
    assert power_of_two([2], ongoing, rng) == 2


def test_the_day_runs_from_the_command_line_and_writes_the_four_configurations(tmp_path, capsys):
    from carpool.cli import main

    out = tmp_path / "day.json"
    step = "0.02,0.0001,0.004"
    argv = ["bench", "simulate", "--day", "--scale", "1", "--step", step, "--users", "2,4", "--slice-seconds", "5"]
    assert main([*argv, "--batch-lines", "40", "--out", str(out), "--plot", str(tmp_path / "day.png")]) == 0
    report = json.loads(out.read_text())
    assert [run["name"] for run in report["runs"]] == ["fixed-1", "fixed-2", "autoscaled-1:2", "autoscaled-1:2+plan"]
    assert report["users"] == [2, 4] and report["plan"]["minute_seconds"] == 5.0
    assert (tmp_path / "day.png").stat().st_size > 0
    assert "autoscaled-1:2+plan" in capsys.readouterr().out


def test_a_nightly_batch_job_arrives_at_its_slice():
    # `--batch-at 1`: the job's lines are sent when slice 1 begins, none run in slice 0.
    traffic = DayTraffic(
        users=(2, 0, 0),
        slice_seconds=10.0,
        prompts=(32,),
        chat_max_tokens=16,
        batch_lines=40,
        batch_at=1,
        batch_max_tokens=8,
    )
    report = run_day(traffic, Scaling("fixed", 1, 1), STEP, SLO).report(100.0, 2000.0, 0.10)
    assert report["slices"][0]["batch_lines_completed"] == 0
    assert report["slices"][1]["batch_lines_completed"] > 0 and report["batch_lines_completed"] == 40
