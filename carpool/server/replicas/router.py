"""The ingress's engine: what the app asks of an AsyncEngine (the door, generate, abort, snapshot, lifecycle),
answered by routing each request to one engine replica on Ray Serve. `EngineRouter` is what both modes share;
`ReplicaRouter` routes over a fixed count of replicas itself (carpool.server.replicas.routing), AutoscaledRouter
(autoscaled.py) leaves the choice to Ray Serve's router over an autoscaled deployment.

Failure: a replica that dies (its process killed, its node lost) fails its streams with Ray's actor error. A
request that has shown its client nothing yet, and any Batch API line, is sent again to another replica (the
batch line restarts from its first token; it has no client watching); an interactive request already streaming
fails with a retryable 5xx (the app's "engine failed" answer), never a hang. The replica is marked down and
routed around until its status answers again, which is when Ray has restarted it (with an empty cache, so the
router forgets what it held).
"""

import asyncio
import dataclasses
import threading
from collections.abc import AsyncIterator, Callable

from prometheus_client import Counter, Gauge
from ray.exceptions import RayActorError, RayTaskError

from carpool.engine.async_engine import EngineSnapshot
from carpool.engine.block_manager import PinStats
from carpool.engine.config import EngineConfig
from carpool.engine.door import RequestDoor
from carpool.engine.outputs import RequestOutput
from carpool.engine.request import EngineRequest
from carpool.engine.tiers import BATCH_TIER
from carpool.server.replicas.routing import ReplicaLoad, Routing, least_loaded

POLL_SECONDS = 0.5  # replicas' KV usage and health; in-flight counts are the router's own, always current
CALL_TIMEOUT = 5.0  # a status or metrics call that takes longer: the replica is down (or restarting)
BATCH_RETRY_SECONDS = 120.0  # how long a batch line waits for some replica to take it again


class ReplicaFailed(RuntimeError):
    """A replica died under a request that could not be sent again: retry it (another replica will take it)."""


class EngineRouter:
    """The AsyncEngine interface over replicas, and the retry rules. A mode supplies where a request goes
    (`_send`), what a finished or failed attempt means to it (`_done`, `_failed`), its replicas' last snapshots and
    metrics texts, and `_poll`, which keeps them current."""

    def __init__(self, model_name: str, door: RequestDoor, config: EngineConfig, attempts: int):
        self.model_name, self.attempts = model_name, attempts  # attempts: an interactive request's, at most
        self.door = self.engine = door  # Serving compiles grammars on `engine.engine`, as with an AsyncEngine
        self.tokenizer, self.max_model_len = door.tokenizer, door.max_model_len
        self.config = config
        self.ready = threading.Event()  # the replicas have reported themselves warmed up
        self._loop: asyncio.AbstractEventLoop | None = None
        self._poller: asyncio.Task | None = None

    # The AsyncEngine interface the app uses -----------------------------------------------------------

    @property
    def error(self) -> BaseException | None:
        """Set while no replica answers (after start-up): /health is then a 503."""
        if self.ready.is_set() and self.live_replicas == 0:
            return RuntimeError("no replica is reachable (Ray is restarting them)")
        return None

    def add_step_listener(self, listener: Callable) -> None:
        """Steps run on the replicas: their per-step series come from the replicas' own registries (labelled
        `replica` in /metrics, see carpool.server.replicas.metrics), not from listeners here."""

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._poller = self._loop.create_task(self._poll())

    def stop(self) -> None:
        if self._poller is not None:
            self._poller.cancel()

    def abort(self, request_id: str) -> None:
        """Nothing to send: leaving `generate()` cancels the replica's stream, which aborts the request there."""

    def snapshot(self) -> EngineSnapshot:
        """Every replica's last report, summed (KV usage: the share of all their blocks in use)."""
        known = self._snapshots()
        blocks = sum(s.num_blocks for s in known)
        free = sum(s.num_free_blocks for s in known)
        return EngineSnapshot(
            num_running=sum(s.num_running for s in known),
            num_waiting=sum(s.num_waiting for s in known),
            kv_cache_usage=1 - free / blocks if blocks else 0.0,
            num_free_blocks=free,
            num_blocks=blocks,
            block_size=known[0].block_size if known else 0,
            num_cached_blocks=sum(s.num_cached_blocks for s in known),
            pins=PinStats.summed([s.pins for s in known]),
            kv_block_bytes=known[0].kv_block_bytes if known else 0,
            kv_pool_bytes=sum(s.kv_pool_bytes for s in known),
            kv_resident_bytes=sum(s.kv_resident_bytes for s in known),
        )

    async def generate(self, request: EngineRequest) -> AsyncIterator[RequestOutput]:
        wire = _without_compiled_grammar(request)
        batch = request.tier == BATCH_TIER
        retry_until = asyncio.get_running_loop().time() + BATCH_RETRY_SECONDS
        tried: list = []
        while True:
            replica, stream = self._send(request, wire, tried)
            tried.append(replica)
            shown = finished = False
            try:
                async for output in stream:
                    shown = True
                    finished = output.finished
                    yield output
                return
            except RayTaskError as error:  # the engine raised: the replica is fine, the request failed
                raise RuntimeError(str(error.cause if error.cause is not None else error)) from None
            except RayActorError as error:
                self._failed(replica)
                if shown and not batch:
                    raise ReplicaFailed(
                        f"replica {replica} of {self.model_name!r} failed mid-response; retry the "
                        f"request ({type(error).__name__})"
                    ) from None
                if not batch and len(tried) >= self.attempts:
                    raise ReplicaFailed(f"no replica of {self.model_name!r} could take the request; retry it") from None
                if batch and asyncio.get_running_loop().time() > retry_until:
                    raise ReplicaFailed(
                        f"no replica of {self.model_name!r} came back in {BATCH_RETRY_SECONDS:.0f} s"
                    ) from None
                if batch and self.live_replicas == 0:
                    await asyncio.sleep(POLL_SECONDS)
            finally:
                self._done(replica)
                if not finished:
                    stream.cancel()

    # What a mode supplies -----------------------------------------------------------------------------

    @property
    def live_replicas(self) -> int:
        raise NotImplementedError

    def _send(self, request: EngineRequest, wire: EngineRequest, tried: list) -> tuple:
        """(the replica's key, its output stream) for one attempt; `tried`: the keys of earlier attempts."""
        raise NotImplementedError

    def _done(self, replica) -> None:
        """An attempt ended (finished, failed or abandoned)."""

    def _failed(self, replica) -> None:
        """The replica died under an attempt."""

    def _snapshots(self) -> list[EngineSnapshot]:
        raise NotImplementedError

    def metrics_texts(self) -> dict[str, str]:
        """{replica: its /metrics text}; called from a worker thread."""
        raise NotImplementedError

    async def _poll(self) -> None:
        raise NotImplementedError


class ReplicaRouter(EngineRouter):
    """A fixed count of replicas, each addressed by its own handle and chosen by `routing`."""

    def __init__(
        self,
        model_name: str,
        handles: list,
        door: RequestDoor,
        config: EngineConfig,
        routing: Routing,
        slots_per_replica: int,
    ):
        super().__init__(
            model_name, door, dataclasses.replace(config, max_num_seqs=slots_per_replica * len(handles)), len(handles)
        )
        self.replicas, self.routing = handles, routing
        self.loads = [ReplicaLoad(slots=slots_per_replica) for _ in handles]
        self.snapshots: list[EngineSnapshot | None] = [None] * len(handles)
        self.pids: list[int | None] = [None] * len(handles)
        self._routed: Counter | None = None
        self._up: Gauge | None = None

    @property
    def live_replicas(self) -> int:
        return sum(load.healthy for load in self.loads)

    def _send(self, request: EngineRequest, wire: EngineRequest, tried: list) -> tuple:
        index = self._choose(request, set(tried))
        self.loads[index].in_flight += 1
        if self._routed is not None:
            self._routed.labels(self.model_name, str(index)).inc()
        return index, self.replicas[index].options(stream=True).generate.remote(wire)

    def _done(self, replica: int) -> None:
        self.loads[replica].in_flight -= 1

    def _failed(self, replica: int) -> None:
        self._mark_down(replica)

    def _snapshots(self) -> list[EngineSnapshot]:
        return [s for s in self.snapshots if s is not None]

    # Routing and health -------------------------------------------------------------------------------

    def _choose(self, request: EngineRequest, tried: set[int]) -> int:
        if not tried:
            return self.routing.choose(request, self.loads)
        # A retry: the least loaded replica it has not failed on yet (any, once it has tried them all).
        untried = [
            load if i not in tried else dataclasses.replace(load, healthy=False) for i, load in enumerate(self.loads)
        ]
        return least_loaded(untried if any(load.healthy for load in untried) else self.loads)

    def _mark_down(self, index: int) -> None:
        if self.loads[index].healthy:
            self.loads[index].healthy = False
            self.routing.forget(index)
            if self._up is not None:
                self._up.labels(self.model_name, str(index)).set(0)

    async def _call(self, index: int, method: str):
        return await asyncio.wait_for(awaited(getattr(self.replicas[index], method).remote()), CALL_TIMEOUT)

    async def _poll(self) -> None:
        while True:
            await asyncio.gather(*(self._poll_one(i) for i in range(len(self.replicas))))
            await asyncio.sleep(POLL_SECONDS)

    async def _poll_one(self, index: int) -> None:
        try:
            status = await self._call(index, "status")
        except Exception:  # dead, restarting, or too slow to answer: route around it until it answers
            self._mark_down(index)
            return
        load = self.loads[index]
        if self.pids[index] not in (None, status["pid"]):  # Ray restarted it: its cache is empty
            self.routing.forget(index)
        self.pids[index], self.snapshots[index] = status["pid"], status["snapshot"]
        load.kv_usage = status["snapshot"].kv_cache_usage
        load.healthy = status["error"] is None
        if self._up is not None:
            self._up.labels(self.model_name, str(index)).set(1 if load.healthy else 0)
        if status["ready"] and all(s is not None for s in self.snapshots):
            self.ready.set()

    # Metrics ------------------------------------------------------------------------------------------

    def register_metrics(self, routed: Counter, up: Gauge, replicas: Gauge) -> None:
        self._routed, self._up = routed, up
        replicas.labels(self.model_name).set_function(lambda: self.live_replicas)
        for index in range(len(self.replicas)):
            routed.labels(self.model_name, str(index))
            up.labels(self.model_name, str(index)).set(1)

    def metrics_texts(self) -> dict[str, str]:
        """Fetched through the event loop (called from a worker thread); a replica that does not answer is left
        out."""
        return asyncio.run_coroutine_threadsafe(self._metrics_texts(), self._loop).result(CALL_TIMEOUT + 1)

    async def _metrics_texts(self) -> dict[str, str]:
        texts = await asyncio.gather(
            *(self._call(i, "metrics_text") for i in range(len(self.replicas))), return_exceptions=True
        )
        return {str(i): text for i, text in enumerate(texts) if isinstance(text, str)}


async def awaited(response):
    return await response


def _without_compiled_grammar(request: EngineRequest) -> EngineRequest:
    """Compiled grammars are native objects and do not cross processes: the replica compiles the spec again (its
    cache hits after the first)."""
    spec = request.params.structured
    if spec is None:
        return request
    plain = dataclasses.replace(spec, grammar=None)
    return dataclasses.replace(request, params=dataclasses.replace(request.params, structured=plain))
