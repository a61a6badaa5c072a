"""One engine replica: a Ray Serve deployment holding an AsyncEngine with a thread budget of its own.

Each replica is its own deployment (`engine-<model>-<i>`, one Ray actor), so the router can address it and the
Serve controller restarts it when it dies (its health check fails, or its process is gone).
"""

import dataclasses
import os

from ray import serve

from carpool.engine.async_engine import AsyncEngine
from carpool.engine.config import EngineConfig
from carpool.engine.request import EngineRequest
from carpool.server.metrics import ServerMetrics


class EngineReplica:
    def __init__(self, config: EngineConfig, model_name: str, index: int, warmup: bool = True):
        self.index, self.model_name = index, model_name
        # Its own thread: Ray owns the replica's main thread. With one torch thread a replica there is no
        # OpenMP spin-wait to lose (AsyncEngine's note on the main thread is about 2+ threads on 2 cores).
        self.engine = AsyncEngine(config, warmup=warmup)
        self.metrics = ServerMetrics([model_name])
        self.engine.add_step_listener(self.metrics.models[model_name].on_step)
        self.engine.start()

    async def generate(self, request: EngineRequest):
        """The request's outputs as the engine makes them; a cancelled call (the ingress's client left, or the
        router gave up) aborts it, through AsyncEngine.generate's own clean-up."""
        structured = request.params.structured
        if structured is not None:  # compiled grammars do not cross processes: the ingress sends the spec
            params = dataclasses.replace(request.params, structured=self.engine.engine.grammars.bind(structured))
            request = dataclasses.replace(request, params=params)
        async for output in self.engine.generate(request):
            yield output

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

    def check_health(self) -> None:
        """Ray Serve's health check: a replica whose engine loop died is restarted."""
        if self.engine.error is not None:
            raise RuntimeError(f"engine stopped: {self.engine.error!r}")


def replica_deployment(config: EngineConfig, model_name: str, index: int, warmup: bool):
    """The bound deployment of one replica: as many Ray CPUs as its torch threads, each its own OMP pool."""
    threads = config.num_threads or 1
    deployment = serve.deployment(
        EngineReplica,
        name=f"engine-{model_name.replace('/', '_')}-{index}",
        num_replicas=1,
        max_ongoing_requests=4096,  # the engine queues and schedules by tier; Serve must not queue in front of it
        health_check_period_s=2,
        health_check_timeout_s=30,
        logging_config={"log_level": "WARNING", "enable_access_log": False},  # the router polls twice a second
        ray_actor_options={"num_cpus": threads, "runtime_env": {"env_vars": {"OMP_NUM_THREADS": str(threads)}}},
    )
    return deployment.bind(dataclasses.replace(config, num_threads=threads), model_name, index, warmup)
