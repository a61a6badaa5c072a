"""`--replicas MIN:MAX` without Ray's processes: the flag, the autoscaling policy's numbers (as Ray's controller
would call it), and the autoscaled router's retries and sums."""

import asyncio
import json
import os
import threading
import time
import types

import pytest

from carpool.server.replicas.autoscaling import (
    BATCH_ONGOING,
    LIVE_CAPACITY,
    PlannedPolicy,
    desired_replicas,
    plan_floor,
    policy,
)
from carpool.server.replicas.counts import ReplicaCount, capacity_plan, parse_replicas, scale_down_delay

SLOTS = 4  # target ongoing requests per replica
UPSCALE_DELAY, TICK = 2.0, 1.0  # Ray's, as carpool deploys an autoscaled model


def test_replicas_is_a_count_or_a_range():
    assert parse_replicas("3") == parse_replicas("3:3") == ReplicaCount(3, 3)
    assert not ReplicaCount(3, 3).autoscaled and str(ReplicaCount(3, 3)) == "3"
    assert parse_replicas(" 1:4 ").autoscaled and str(parse_replicas("1:4")) == "1:4"
    for bad in ("0", "0:2", "3:1", "two", "1:", "1:2:3", "", "-1:2"):
        with pytest.raises(ValueError, match="--replicas"):
            parse_replicas(bad)


def test_a_bad_replicas_flag_is_an_argparse_error_naming_it(capsys):
    from carpool.cli import build_parser

    assert build_parser().parse_args(["serve", "--replicas", "1:3"]).replicas == ReplicaCount(1, 3)
    assert build_parser().parse_args(["serve"]).replicas is None  # one engine in-process
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--replicas", "3:1"])
    assert "argument --replicas: MIN:MAX with MIN <= MAX" in capsys.readouterr().err


def test_scale_down_delay_is_refused_where_it_would_do_nothing():
    from carpool.cli import build_parser

    def delay(*flags):
        return scale_down_delay(build_parser().parse_args(["serve", *flags]))

    assert delay("--replicas", "1:2") == 60 and delay("--replicas", "1:2", "--scale-down-delay", "5") == 5
    for fixed in ((), ("--replicas", "2"), ("--replicas", "2:2")):
        with pytest.raises(ValueError, match="--scale-down-delay: only with --replicas MIN:MAX"):
            delay(*fixed, "--scale-down-delay", "5")
    with pytest.raises(ValueError, match="--scale-down-delay: must be 0 or more"):
        delay("--replicas", "1:2", "--scale-down-delay", "-1")


def test_live_load_scales_up_as_rays_default_policy_would():
    assert desired_replicas(live_ongoing=12, batch_ongoing=0, target_ongoing=SLOTS, min_replicas=1) == 3
    assert desired_replicas(live_ongoing=2, batch_ongoing=0, target_ongoing=SLOTS, min_replicas=1) == 0.5


def test_a_batch_backlog_alone_takes_the_valleys_spare_replicas():
    # 64 lines in flight at 4 slots a replica: 16 wanted, which Ray bounds to MAX.
    assert desired_replicas(live_ongoing=0, batch_ongoing=64, target_ongoing=SLOTS, min_replicas=1) == 16
    # Some live traffic, still below MIN's capacity: the backlog counts with it.
    assert desired_replicas(live_ongoing=2, batch_ongoing=10, target_ongoing=SLOTS, min_replicas=1) == 3


def test_a_batch_backlog_adds_no_replica_while_live_load_is_high():
    assert desired_replicas(live_ongoing=8, batch_ongoing=64, target_ongoing=SLOTS, min_replicas=1) == 2
    assert desired_replicas(live_ongoing=8, batch_ongoing=0, target_ongoing=SLOTS, min_replicas=1) == 2


def test_idle_scales_down():
    assert desired_replicas(live_ongoing=0, batch_ongoing=0, target_ongoing=SLOTS, min_replicas=2) == 0  # to MIN


def context(total, batch_by_replica, current=2, min_replicas=1, capacity_by_replica=None):
    """What Ray's controller hands the policy, with the fields it reads."""
    return types.SimpleNamespace(
        current_num_replicas=current,
        target_num_replicas=current,
        total_num_requests=total,
        aggregated_metrics={BATCH_ONGOING: batch_by_replica, LIVE_CAPACITY: capacity_by_replica or {}},
        capacity_adjusted_min_replicas=min_replicas,
        config=types.SimpleNamespace(
            get_target_ongoing_requests=lambda: SLOTS, upscale_delay_s=UPSCALE_DELAY, metrics_interval_s=TICK
        ),
    )


def test_the_policy_reads_rays_total_and_the_replicas_batch_counts():
    # Ray's total counts every request; the batch lines are the replicas' own report, the rest is live.
    assert policy(context(total=40, batch_by_replica={"a": 20.0, "b": 20.0})) == (10, {})  # a valley: all count
    assert policy(context(total=48, batch_by_replica={"a": 20.0, "b": 20.0})) == (2, {})  # live 8: batch waits
    assert policy(context(total=4, batch_by_replica={}))[0] == 1  # no report yet: all counted as live
    assert policy(context(total=4, batch_by_replica={}, current=0)) == (0, {})  # starting: Ray's own target


def test_under_an_itl_slo_the_replicas_live_capacity_is_the_target_not_their_slots():
    # Ten chats on replicas that each carry 4 within the SLO: three replicas, where the slots (64) say one is idle.
    many_slots = {"a": 4.0, "b": 4.0}
    assert policy(context(total=10, batch_by_replica={}, capacity_by_replica=many_slots))[0] == 2.5
    # The batch lines still wait in a peak, and the capacities are averaged (a busier replica fits fewer).
    assert policy(context(total=30, batch_by_replica={"a": 20.0}, capacity_by_replica={"a": 3.0, "b": 7.0}))[0] == 2


def test_the_policy_runs_under_rays_own_wrapper():
    pytest.importorskip("ray.serve", reason="needs `make scale`")
    from ray.serve.autoscaling_policy import _apply_autoscaling_config
    from ray.serve.config import AutoscalingConfig, AutoscalingContext

    config = AutoscalingConfig(
        min_replicas=1, max_replicas=3, target_ongoing_requests=SLOTS, upscale_delay_s=0, downscale_delay_s=0
    )
    ctx = AutoscalingContext(
        deployment_id=None,
        deployment_name="engine-m",
        app_name="engine-m",
        current_num_replicas=1,
        target_num_replicas=1,
        running_replicas=["a"],
        total_num_requests=12.0,
        total_queued_requests=0.0,
        aggregated_metrics={BATCH_ONGOING: {"a": 0.0}},
        raw_metrics={},
        capacity_adjusted_min_replicas=1,
        capacity_adjusted_max_replicas=3,
        policy_state={},
        last_scale_up_time=None,
        last_scale_down_time=None,
        current_time=None,
        config=config,
    )
    assert _apply_autoscaling_config(policy)(ctx)[0] == 3


# The autoscaled router ---------------------------------------------------------------------------------------


def autoscaled_router(handle):
    pytest.importorskip("ray.serve", reason="needs `make scale`")
    from carpool.engine.config import EngineConfig
    from carpool.server.replicas.autoscaled import AutoscaledRouter
    from tests.server.test_replicas_routing import Door

    return AutoscaledRouter("m", handle, None, Door(), EngineConfig(), ReplicaCount(1, 2), 8)


def flaky_handle(*dies_after):
    """A handle to an autoscaled deployment whose n-th call's stream dies after `dies_after[n]` outputs."""
    from tests.server.test_replicas_routing import FakeReplica, FakeStream

    class Flaky(FakeReplica):
        def remote(self, wire):
            self.calls += 1
            return FakeStream(wire, dies_after[self.calls - 1])

    return Flaky(None)


async def outputs(router, req):
    return [output async for output in router.generate(req)]


def test_the_autoscaled_router_sends_again_what_showed_nothing_and_fails_a_cut_stream_retryably():
    from carpool.server.replicas.router import ReplicaFailed
    from tests.server.test_replicas_routing import request

    handle = flaky_handle(0, None)
    assert asyncio.run(outputs(autoscaled_router(handle), request([1, 2, 3])))[-1].finished and handle.calls == 2
    with pytest.raises(ReplicaFailed, match="retry"):
        asyncio.run(outputs(autoscaled_router(flaky_handle(1, None)), request([1, 2, 3])))
    handle = flaky_handle(1, 2, None)  # a batch line restarts however far it got
    assert asyncio.run(outputs(autoscaled_router(handle), request([1, 2, 3], tier="batch")))[-1].finished
    assert handle.calls == 3
    with pytest.raises(ReplicaFailed, match="no replica"):  # interactive: at most MAX attempts
        asyncio.run(outputs(autoscaled_router(flaky_handle(0, 0, None)), request([1, 2, 3])))


def test_the_autoscaled_router_sums_the_boards_reports():
    from carpool.engine.async_engine import EngineSnapshot
    from carpool.engine.block_manager import PinStats

    def snapshot(running, free):
        return EngineSnapshot(running, 0, 1 - free / 100, free, 100, 16, 0, PinStats(), 1024, 100 * 1024, 0)

    router = autoscaled_router(flaky_handle())
    assert router.live_replicas == 0 and router.snapshot().num_running == 0
    router.reports = {
        "a": {"snapshot": snapshot(2, 50), "metrics": "a-text", "ready": True},
        "b": {"snapshot": snapshot(1, 100), "metrics": "b-text", "ready": True},
    }
    total = router.snapshot()
    assert (total.num_running, total.num_blocks, total.kv_cache_usage) == (3, 200, 0.25)
    assert router.metrics_texts() == {"a": "a-text", "b": "b-text"} and router.live_replicas == 2


# The replica's constructor: Serve routes to a replica once it returns ------------------------------------------


class SlowEngine:
    """An AsyncEngine's start-up as the replica sees it: `ready` set by the engine thread after the warm-up, or
    `error` set when the warm-up fails."""

    def __init__(self, fails: bool):
        self.fails, self.ready, self.error = fails, threading.Event(), None

    def add_step_listener(self, listener):
        pass

    def start(self):
        def warm_up():
            time.sleep(0.3)
            if self.fails:
                self.error = RuntimeError("warm-up failed")
            else:
                self.ready.set()

        threading.Thread(target=warm_up).start()


def test_the_replica_returns_only_once_warm_and_raises_when_its_engine_fails(monkeypatch):
    pytest.importorskip("ray.serve", reason="needs `make scale`")
    from carpool.server.replicas import replica

    monkeypatch.setattr(replica, "AsyncEngine", lambda config, warmup: SlowEngine(fails=False))
    started = time.monotonic()
    assert replica.EngineReplica(None, "m").engine.ready.is_set() and time.monotonic() - started >= 0.3
    monkeypatch.setattr(replica, "AsyncEngine", lambda config, warmup: SlowEngine(fails=True))
    with pytest.raises(RuntimeError, match="failed to start.*warm-up failed"):
        replica.EngineReplica(None, "m")


# Predictive pre-warm: a capacity plan's replicas as a floor -------------------------------------------------------

T = 1_800_000_000.0  # a minute boundary


def plan_file(path, minutes, lead=45.0):
    path.write_text(
        json.dumps({"minutes": [{"at": at, "replicas": n} for at, n in minutes], "replica_start_seconds": lead})
    )
    return str(path)


def test_the_plan_floor_starts_each_minutes_replicas_ahead_by_the_start_time():
    document = {"minutes": [{"at": T, "replicas": 1}, {"at": T + 60, "replicas": 3}], "replica_start_seconds": 45.0}
    assert plan_floor(document, T + 14) == 1 and plan_floor(document, T + 15) == 3  # 45 s before 3 are needed
    assert plan_floor(document, T + 119) == 3 and plan_floor(document, T + 120) == 0  # past the plan: no floor
    # The trace bench's compressed day: "minutes" of 20 s.
    compressed = {"minutes": [{"at": T, "replicas": 1}, {"at": T + 20, "replicas": 3}], "minute_seconds": 20.0}
    compressed["replica_start_seconds"] = 5.0
    assert plan_floor(compressed, T + 14) == 1 and plan_floor(compressed, T + 15) == 3
    assert plan_floor(compressed, T + 39) == 3 and plan_floor(compressed, T + 40) == 0
    assert plan_floor(document, T - 46) == 0


def test_the_planned_policy_keeps_the_floor_and_follows_a_new_plan(tmp_path):
    path = plan_file(tmp_path / "plan.json", [(T, 3)])
    planned = PlannedPolicy(path)
    idle = context(total=0, batch_by_replica={}, current=1)
    idle.current_time = T + 10
    assert planned(idle)[0] == 3  # no load, but the plan wants 3 up
    busy = context(total=20, batch_by_replica={}, current=1)
    busy.current_time = T + 10
    assert planned(busy)[0] == 5  # load above the floor: the load's answer
    # The floor is read 3 s ahead (Ray's upscale delay and a tick), on top of the plan's own 45 s lead.
    early = context(total=0, batch_by_replica={}, current=1)
    early.current_time = T - 45 - 3
    assert planned(early)[0] == 3
    early.current_time -= 0.1
    assert planned(early)[0] == 0  # before it: the load's answer (none)
    plan_file(tmp_path / "plan.json", [(T, 1)])
    os.utime(path, (T, T))  # a re-plan (its own mtime, whatever the clock's resolution)
    assert planned(idle)[0] == 1
    (tmp_path / "plan.json").write_text("{half a re-plan")
    os.utime(path, (T + 1, T + 1))
    assert planned(idle)[0] == 1  # the last good plan stands


def test_rays_controller_makes_the_planned_policy_with_the_deployments_kwargs(tmp_path):
    pytest.importorskip("ray.serve", reason="needs `make scale`")
    from ray.serve._private.autoscaling_state import _resolve_policy_callable
    from ray.serve.config import AutoscalingPolicy

    from carpool.server.replicas.replica import PLANNED_POLICY

    path = plan_file(tmp_path / "plan.json", [(T, 2)])
    made = _resolve_policy_callable(AutoscalingPolicy(policy_function=PLANNED_POLICY, policy_kwargs={"plan": path}))
    assert type(made).__name__ == "PlannedPolicy" and made.path == path


def test_capacity_plan_is_checked_before_anything_starts(tmp_path):
    from carpool.cli import build_parser

    def plan(*flags):
        return capacity_plan(build_parser().parse_args(["serve", *flags]))

    good = plan_file(tmp_path / "plan.json", [(T, 2)])
    assert plan("--replicas", "1:3") is None
    assert plan("--replicas", "1:3", "--capacity-plan", os.path.relpath(good)) == good
    with pytest.raises(ValueError, match="--capacity-plan: only with --replicas MIN:MAX"):
        plan("--replicas", "3", "--capacity-plan", good)
    (tmp_path / "bad.json").write_text('{"minutes": [{"at": 1}]}')
    for bad in (tmp_path / "bad.json", tmp_path / "missing.json"):
        with pytest.raises(ValueError, match="--capacity-plan: .* is not a `carpool capacity plan --format json`"):
            plan("--replicas", "1:3", "--capacity-plan", str(bad))


def test_a_plan_from_carpool_capacity_plan_prewarms_ahead_of_its_peak(tmp_path, capsys):
    from carpool.cli import main
    from tests.economics.test_capacity import DAY, NINE, PHASES, synthetic_ledger

    synthetic_ledger(tmp_path / "carpool.db")
    bench = tmp_path / "run.json"
    bench.write_text(json.dumps({"phases": PHASES.as_dict()}))
    argv = ["capacity", "plan", "--db", str(tmp_path / "carpool.db"), "--bench", str(bench)]
    argv += ["--at", str(NINE + 3 * DAY - 15 * 60), "--smooth-minutes", "0", "--target-utilization", "0.5"]
    assert main([*argv, "--replica-start-seconds", "45", "--format", "json"]) == 0
    (tmp_path / "plan.json").write_text(capsys.readouterr().out)
    document = json.loads((tmp_path / "plan.json").read_text())
    (start,) = [a["at"] for a in document["actions"] if a["action"].startswith("start")]
    planned = PlannedPolicy(str(tmp_path / "plan.json"))
    idle = context(total=0, batch_by_replica={}, current=1)
    # The second replica starts 45 s before the peak's minute: the policy asks Ray's delay and a tick before that.
    idle.current_time = start - UPSCALE_DELAY - TICK - 0.1
    assert planned(idle)[0] == 1
    idle.current_time = start - UPSCALE_DELAY - TICK
    assert planned(idle)[0] == 2
