"""`--replicas MIN:MAX` without Ray's processes: the flag, the autoscaling policy's numbers (as Ray's controller
would call it), and the autoscaled router's retries and sums."""

import asyncio
import threading
import time
import types

import pytest

from carpool.server.replicas.autoscaling import BATCH_ONGOING, LIVE_ONGOING, desired_replicas, policy
from carpool.server.replicas.counts import ReplicaCount, parse_replicas, scale_down_delay

SLOTS = 4  # target ongoing requests per replica


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


def context(total, batch_by_replica, current=2, min_replicas=1):
    """What Ray's controller hands the policy, with the fields it reads."""
    return types.SimpleNamespace(
        current_num_replicas=current,
        target_num_replicas=current,
        total_num_requests=total,
        aggregated_metrics={
            BATCH_ONGOING: batch_by_replica,
            LIVE_ONGOING: {replica: 0.0 for replica in batch_by_replica},
        },
        capacity_adjusted_min_replicas=min_replicas,
        config=types.SimpleNamespace(get_target_ongoing_requests=lambda: SLOTS),
    )


def test_the_policy_reads_rays_total_and_the_replicas_batch_counts():
    # Ray's total counts every request; the batch lines are the replicas' own report, the rest is live.
    assert policy(context(total=40, batch_by_replica={"a": 20.0, "b": 20.0})) == (10, {})  # a valley: all count
    assert policy(context(total=48, batch_by_replica={"a": 20.0, "b": 20.0})) == (2, {})  # live 8: batch waits
    assert policy(context(total=4, batch_by_replica={}))[0] == 1  # no report yet: all counted as live
    assert policy(context(total=4, batch_by_replica={}, current=0)) == (0, {})  # starting: Ray's own target


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
        aggregated_metrics={BATCH_ONGOING: {"a": 0.0}, LIVE_ONGOING: {"a": 12.0}},
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
