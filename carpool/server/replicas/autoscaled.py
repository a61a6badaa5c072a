"""The ingress's engine for `--replicas MIN:MAX`: one handle to the model's autoscaled deployment, whose replica
count Ray Serve's autoscaler sets (carpool.server.replicas.autoscaling) and whose replica each request lands on
Ray Serve's own router picks (power of two choices on queue length; the fixed mode's prefix affinity needs a
handle per replica, which an autoscaled deployment does not give). The retry rules are EngineRouter's.

The replicas' snapshots and metrics texts come from the model's board (board.py), read twice a second: a replica
joins the sums when it starts posting (after its warm-up) and leaves them when it stops (drained and removed).
"""

import asyncio
import dataclasses

from prometheus_client import Counter, Gauge

from carpool.engine.async_engine import EngineSnapshot
from carpool.engine.config import EngineConfig
from carpool.engine.door import RequestDoor
from carpool.engine.request import EngineRequest
from carpool.server.replicas.counts import ReplicaCount
from carpool.server.replicas.router import CALL_TIMEOUT, POLL_SECONDS, EngineRouter, awaited


class AutoscaledRouter(EngineRouter):
    def __init__(
        self,
        model_name: str,
        handle,
        board,
        door: RequestDoor,
        config: EngineConfig,
        count: ReplicaCount,
        slots_per_replica: int,
    ):
        # Slots: as many as MAX replicas hold, so the Batch API keeps enough lines in flight for the autoscaler
        # to see a backlog that fills the spare replicas (it counts ongoing requests, not the batch's queue).
        super().__init__(
            model_name, door, dataclasses.replace(config, max_num_seqs=slots_per_replica * count.max), count.max
        )
        self.handle, self.board, self.count = handle, board, count
        self.reports: dict[str, dict] = {}

    @property
    def live_replicas(self) -> int:
        return len(self.reports)

    def _send(self, request: EngineRequest, wire: EngineRequest, tried: list) -> tuple:
        """Ray's router picks the replica, and leaves out one that died once Serve's controller notices."""
        return len(tried), self.handle.options(stream=True).generate.remote(wire)

    def _snapshots(self) -> list[EngineSnapshot]:
        return [report["snapshot"] for report in self.reports.values()]

    def metrics_texts(self) -> dict[str, str]:
        return {replica: report["metrics"] for replica, report in self.reports.items()}

    def register_metrics(self, routed: Counter, up: Gauge, replicas: Gauge) -> None:
        """Only `carpool:replicas`: which replica a request lands on is Ray's choice, unseen here."""
        replicas.labels(self.model_name).set_function(lambda: self.live_replicas)

    async def _poll(self) -> None:
        while True:
            try:
                self.reports = await asyncio.wait_for(awaited(self.board.read.remote()), CALL_TIMEOUT)
            except Exception:  # the board did not answer: no replica can be seen, /health says so
                self.reports = {}
            if sum(report["ready"] for report in self.reports.values()) >= self.count.min:
                self.ready.set()
            await asyncio.sleep(POLL_SECONDS)
