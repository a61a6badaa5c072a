"""One engine replica: a Ray Serve deployment holding an AsyncEngine with a thread budget of its own.

Fixed count (`--replicas N`): each replica is its own deployment (`engine-<model>-<i>`, one Ray actor), so the router
can address it and the Serve controller restarts it when it dies (its health check fails, or its process is gone).
Autoscaled (`--replicas MIN:MAX`): one deployment per model (`engine-<model>`) whose replica count Ray Serve's
autoscaler sets (carpool.server.replicas.autoscaling); its replicas report to the model's board (board.py).

Either way a replica takes traffic only once warm: Serve routes to a replica after its constructor returns, and the
constructor waits for the engine's warm-up (raising, so Serve replaces the replica, when the engine fails to start).
"""

import dataclasses
import os

from ray import serve

from carpool.engine.async_engine import AsyncEngine
from carpool.engine.config import EngineConfig
from carpool.engine.request import EngineRequest
from carpool.engine.tiers import BATCH_TIER
from carpool.server.metrics import ServerMetrics
from carpool.server.replicas.autoscaling import BATCH_ONGOING, LIVE_CAPACITY
from carpool.server.replicas.board import BoardPoster, open_board
from carpool.server.replicas.counts import ReplicaCount

AUTOSCALING_POLICY = "carpool.server.replicas.autoscaling:policy"
PLANNED_POLICY = "carpool.server.replicas.autoscaling:PlannedPolicy"
# A replica Serve removes finishes its streams first: Serve stops routing to it and waits while it has ongoing
# requests, checking every DRAIN_CHECK_SECONDS, for up to DRAIN_SECONDS (a 4,000-token answer at 1 thread, ~20
# tokens/s on 2 cores, with room to spare) before it stops the actor anyway.
DRAIN_CHECK_SECONDS = 1.0
DRAIN_SECONDS = 600.0


class EngineReplica:
    def __init__(self, config: EngineConfig, model_name: str, warmup: bool = True, report_to_board: bool = False):
        self.model_name = model_name
        # Its own thread: Ray owns the replica's main thread. With one torch thread a replica there is no
        # OpenMP spin-wait to lose (AsyncEngine's note on the main thread is about 2+ threads on 2 cores).
        self.engine = AsyncEngine(config, warmup=warmup)
        self.metrics = ServerMetrics([model_name])
        self.engine.add_step_listener(self.metrics.models[model_name].on_step)
        # Batch API lines open here: the autoscaler's input (live demand is Ray's own count less these).
        self.batch_ongoing = 0
        self.engine.start()
        while not self.engine.ready.wait(0.2):
            if self.engine.error is not None:
                raise RuntimeError(f"the engine failed to start: {self.engine.error!r}")
        self._poster = None
        if report_to_board:
            replica = serve.get_replica_context().replica_id.unique_id
            self._poster = BoardPoster(open_board(model_name), replica, self.report)

    async def generate(self, request: EngineRequest):
        """The request's outputs as the engine makes them; a cancelled call (the ingress's client left, or the
        router gave up) aborts it, through AsyncEngine.generate's own clean-up."""
        structured = request.params.structured
        if structured is not None:  # compiled grammars do not cross processes: the ingress sends the spec
            params = dataclasses.replace(request.params, structured=self.engine.engine.grammars.bind(structured))
            request = dataclasses.replace(request, params=params)
        batch = request.tier == BATCH_TIER
        self.batch_ongoing += batch
        try:
            async for output in self.engine.generate(request):
                yield output
        finally:
            self.batch_ongoing -= batch

    def record_autoscaling_stats(self) -> dict[str, float]:
        """Ray Serve's custom autoscaling metrics hook (read by carpool.server.replicas.autoscaling.policy): the
        Batch API lines open here and, under an ITL SLO, the live requests this replica carries within it."""
        engine = self.engine.engine
        capacity = engine.scheduler.slo.live_capacity(engine.config.max_num_seqs) if engine.scheduler.slo else None
        return {BATCH_ONGOING: self.batch_ongoing, **({} if capacity is None else {LIVE_CAPACITY: capacity})}

    def limits(self) -> dict:
        engine = self.engine.engine
        return {
            "max_model_len": engine.max_model_len,
            "max_request_tokens": engine.door.max_request_tokens,
            "block_size": engine.block_manager.block_size,
            "max_num_seqs": engine.config.max_num_seqs,
        }

    def status(self) -> dict:
        return {
            "snapshot": self.engine.snapshot(),
            "ready": self.engine.ready.is_set(),
            "pid": os.getpid(),
            "error": None if self.engine.error is None else repr(self.engine.error),
        }

    def metrics_text(self) -> str:
        return self.metrics.render({self.model_name: self.engine.snapshot()}).decode()

    def report(self) -> dict:
        """What the board holds for this replica: its status and its /metrics text."""
        return {**self.status(), "metrics": self.metrics_text()}

    def check_health(self) -> None:
        """Ray Serve's health check: a replica whose engine loop died is restarted."""
        if self.engine.error is not None:
            raise RuntimeError(f"engine stopped: {self.engine.error!r}")

    def __del__(self):
        """Serve's shutdown, after the drain: off the board at once rather than when its posts lapse."""
        if getattr(self, "_poster", None) is not None:
            self._poster.stop()


def _options(config: EngineConfig) -> dict:
    """As many Ray CPUs as the replica's torch threads, each its own OMP pool."""
    threads = config.num_threads or 1
    return {
        "max_ongoing_requests": 4096,  # the engine queues and schedules by tier; Serve must not queue in front of it
        "health_check_period_s": 2,
        "health_check_timeout_s": 30,
        "logging_config": {"log_level": "WARNING", "enable_access_log": False},  # the router polls twice a second
        "ray_actor_options": {"num_cpus": threads, "runtime_env": {"env_vars": {"OMP_NUM_THREADS": str(threads)}}},
    }


def _threaded(config: EngineConfig) -> EngineConfig:
    return dataclasses.replace(config, num_threads=config.num_threads or 1)


def replica_deployment(config: EngineConfig, model_name: str, index: int, warmup: bool):
    """The bound deployment of one replica of a fixed count."""
    deployment = serve.deployment(EngineReplica, name=app_name(model_name, index), num_replicas=1, **_options(config))
    return deployment.bind(_threaded(config), model_name, warmup)


def autoscaled_deployment(
    config: EngineConfig, model_name: str, count: ReplicaCount, warmup: bool, down_delay: float, plan: str | None
):
    """The bound deployment of a model's MIN:MAX replicas. Target: the replica's slots (a replica with every slot
    busy, and nothing waiting, is what one replica is for); under an ITL SLO the policy reads the replicas' own
    live capacity instead. Scale-up after 2 s of demand above it (a replica takes
    its load and warm-up time to help, so waiting longer only adds to that); scale-down after `down_delay` s of
    demand below, so a lull between bursts keeps its replicas warm. Metrics every second over a 5 s window: Ray's
    10 s default would add up to 10 s to every reaction. (`metrics_interval_s` warns that it is deprecated in favour
    of two environment variables, which Ray 2.60 reads nowhere yet: it is still the knob that works.) `plan`: a
    capacity plan file whose replicas are a floor (autoscaling.PlannedPolicy)."""
    autoscaling = {
        "min_replicas": count.min,
        "max_replicas": count.max,
        "initial_replicas": count.min,
        "target_ongoing_requests": config.max_num_seqs,
        "upscale_delay_s": 2.0,
        "downscale_delay_s": down_delay,
        "metrics_interval_s": 1.0,
        "look_back_period_s": 5.0,
        "policy": (
            {"policy_function": PLANNED_POLICY, "policy_kwargs": {"plan": plan}}
            if plan
            else {"policy_function": AUTOSCALING_POLICY}
        ),
    }
    deployment = serve.deployment(
        EngineReplica,
        name=app_name(model_name),
        autoscaling_config=autoscaling,
        graceful_shutdown_wait_loop_s=DRAIN_CHECK_SECONDS,
        graceful_shutdown_timeout_s=DRAIN_SECONDS,
        **_options(config),
    )
    return deployment.bind(_threaded(config), model_name, warmup, True)


def app_name(model_name: str, index: int | None = None) -> str:
    """The Serve application (and deployment) name: `engine-<model>` autoscaled, `engine-<model>-<i>` fixed."""
    base = f"engine-{model_name.replace('/', '_')}"
    return base if index is None else f"{base}-{index}"
