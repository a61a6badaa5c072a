"""The Batch API as one piece for the app factory: a router to include, and start/stop for the app's lifespan."""

from pathlib import Path

from carpool.economics.contract import Gate
from carpool.server.batch.endpoints import serving_endpoints
from carpool.server.batch.limits import BatchLimits
from carpool.server.batch.routes import create_batch_router
from carpool.server.batch.runner import BatchRunner
from carpool.server.batch.store import BatchStore
from carpool.server.cascade.runner import CascadeServing
from carpool.server.serving import Serving


class BatchService:
    def __init__(
        self,
        serving: Serving,
        gate: Gate,
        batch_dir: str | Path,
        limits: BatchLimits | None = None,
        max_in_flight: int | None = None,
        db: str | None = None,
        cascades: CascadeServing | None = None,
    ):
        """`db`: the PostgreSQL URL that holds the batches' metadata for every replica (None: in `batch_dir`);
        `cascades`: the cascades a line's `model` may name."""
        self.limits = limits = limits or BatchLimits()
        # Enough batch requests to fill every sequence slot the engines have; more would only wait in their queues.
        max_in_flight = max_in_flight or serving.max_num_seqs
        self.store = BatchStore(batch_dir, db)
        endpoints = serving_endpoints(serving, cascades or CascadeServing(serving, {}))
        self.runner = BatchRunner(self.store, endpoints, limits, max_in_flight)
        self.router = create_batch_router(self.store, self.runner, gate, limits)

    async def start(self) -> None:
        await self.runner.start()

    async def stop(self) -> None:
        await self.runner.stop()
        self.store.close()
