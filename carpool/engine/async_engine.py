"""The one door between the server and the engine: an engine loop on its own thread, driven from asyncio.

`generate()` yields a RequestOutput per step in which the request made progress; leaving the iteration early
(a client that disconnects) aborts the request, and its blocks are back in the pool by the next step.
All engine state is touched only by the engine thread; other threads send it commands: an EngineRequest,
checked at the door (`request()`) on the sender's thread, to add, or an Abort.

The engine thread is either a thread of its own (`start()`) or the caller's (`run()`, what `carpool serve` does
with the main thread, the HTTP server on another). The main thread is faster for this: torch's OpenMP workers
already serve it, and a second thread driving parallel regions oversubscribes a small machine, at which point
libgomp stops spin-waiting between regions and every op pays a sleep/wake (a decode step took 27-30 ms on a
thread of its own against 14-18 ms on the main thread, measured on 2 cores). For the same reason several
engines (one per served model) share one EngineLoop, and so one thread, rather than each having its own.
"""

import asyncio
import queue
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from carpool.engine.block_manager import PinStats
from carpool.engine.config import EngineConfig
from carpool.engine.llm_engine import LLMEngine, StepStats
from carpool.engine.outputs import RequestOutput
from carpool.engine.request import EngineRequest
from carpool.engine.warmup import WarmupReport, warm_up


@dataclass(frozen=True)
class Abort:
    """The command to drop a request: the engine frees its blocks and sends its final output."""

    request_id: str


@dataclass
class EngineSnapshot:
    """Gauges read between steps (approximate: the engine thread keeps moving)."""

    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_free_blocks: int
    num_blocks: int
    block_size: int
    num_cached_blocks: int
    pins: PinStats = field(default_factory=PinStats)  # cache breakpoints' TTL pins
    kv_block_bytes: int = 0  # one KV block's bytes, to turn pinned blocks into memory
    kv_pool_bytes: int = 0  # every KV pool's bytes
    kv_resident_bytes: int = 0  # the pools' bytes backed by memory (pages are backed on first touch)


class EngineLoop:
    """The thread that steps engines: each AsyncEngine has one of its own unless given a shared one.

    A shared loop steps, in turn, every engine that has work: one step each per round, so a long request on one
    model cannot hold up another, and an idle engine costs one `has_unfinished_requests()` a round. With none
    busy it sleeps on its command queue, so a server with every model idle uses no CPU.
    """

    def __init__(self):
        self._engines: list[AsyncEngine] = []
        # (engine, EngineRequest or Abort), or None to wake the loop
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._driven_by_caller = False
        self._stopped = threading.Event()

    def add(self, engine: "AsyncEngine") -> None:
        self._engines.append(engine)

    def send(self, engine: "AsyncEngine", command: "EngineRequest | Abort") -> None:
        self._commands.put((engine, command))

    def start(self) -> None:
        """Run the loop on a thread of its own (no-op while it runs, or while `run()` drives it)."""
        if self._thread is None and not self._driven_by_caller:
            self._thread = threading.Thread(target=self._loop, name="carpool-engine", daemon=True)
            self._thread.start()

    def drive_from_caller(self) -> None:
        """Announce that the caller will call `run()`: a `start()` that comes first (an app's startup hook on
        another thread) then leaves the loop to it."""
        self._driven_by_caller = True

    def run(self) -> None:
        """Run the loop on the calling thread until `stop()`."""
        self.drive_from_caller()
        self._loop()

    def stop(self) -> None:
        self._stopped.set()
        self._commands.put(None)
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None

    def _apply(self, item: tuple | None) -> None:
        if item is not None:
            engine, command = item
            engine._apply(command)

    def _apply_pending(self) -> None:
        while True:
            try:
                self._apply(self._commands.get_nowait())
            except queue.Empty:
                return

    def _loop(self) -> None:
        """One engine's failure (its warm-up or a step raising) fails that engine alone: its streams get the error
        and it takes no more work, while the loop goes on stepping the other models."""
        try:
            for engine in self._engines:  # before any command: requests sent meanwhile wait in the queue
                self._guarded(engine, engine._warm_up)
            while not self._stopped.is_set():
                if not any(engine.busy for engine in self._engines):
                    try:  # idle: sleep until something arrives; the timeout lets signals reach a main thread
                        self._apply(self._commands.get(timeout=1.0))
                    except queue.Empty:
                        continue
                for engine in self._engines:
                    self._apply_pending()  # a request that arrived during the last step joins this one
                    if engine.busy:
                        self._guarded(engine, engine._step)
        except BaseException as error:  # the loop must not die silently: fail every open stream of every engine
            for engine in self._engines:
                engine._fail(error)
            raise

    @staticmethod
    def _guarded(engine: "AsyncEngine", work: Callable[[], None]) -> None:
        try:
            work()
        except Exception as error:
            engine._fail(error)


class AsyncEngine:
    def __init__(
        self,
        config: EngineConfig | None = None,
        engine: LLMEngine | None = None,
        engine_loop: EngineLoop | None = None,
        warmup: bool = False,
    ):
        self.engine = engine or LLMEngine(config or EngineConfig())
        self.config = self.engine.config
        self.tokenizer = self.engine.tokenizer
        self.door = self.engine.door  # where the server checks and settles each request, on its own thread
        self.max_model_len = self.engine.max_model_len
        self.engine_loop = engine_loop or EngineLoop()
        self.engine_loop.add(self)
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._step_listeners: list[Callable[[StepStats | None, list[RequestOutput]], None]] = []
        self.error: BaseException | None = None
        # warmup: run every step shape once on the engine thread (carpool.engine.warmup) before serving; until
        # then `ready` is clear and requests wait in the command queue.
        self.warmup = warmup
        self.warmup_report: WarmupReport | None = None  # set before `ready`, when a warm-up ran
        self.ready = threading.Event()
        if not warmup:
            self.ready.set()

    # Lifecycle: that of the engine loop, shared with the other engines on it ------------------------------

    def start(self) -> None:
        self.engine_loop.start()

    def run(self) -> None:
        self.engine_loop.run()

    def stop(self) -> None:
        self.engine_loop.stop()

    def add_step_listener(self, listener: Callable[[StepStats | None, list[RequestOutput]], None]) -> None:
        """Called on the engine thread after every step that ran (with its stats and outputs) and after every
        abort (stats None, the aborted request's final output). Keep it cheap and non-blocking."""
        self._step_listeners.append(listener)

    # Requests ----------------------------------------------------------------------------------------

    async def generate(self, request: EngineRequest) -> AsyncIterator[RequestOutput]:
        if self.error is not None:
            raise RuntimeError(f"engine stopped: {self.error!r}")
        request_id = request.request_id
        stream: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = (asyncio.get_running_loop(), stream)
        self.engine_loop.send(self, request)
        finished = False
        try:
            while not finished:
                item = await stream.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        self.engine_loop.send(self, Abort(request_id))

    def snapshot(self) -> EngineSnapshot:
        scheduler, blocks = self.engine.scheduler, self.engine.block_manager
        pool_bytes, resident_bytes = self.engine.kv_pool_memory()
        return EngineSnapshot(
            num_running=len(scheduler.running),
            num_waiting=len(scheduler.waiting),
            kv_cache_usage=blocks.usage(),
            num_free_blocks=blocks.num_free_blocks,
            num_blocks=blocks.num_blocks,
            block_size=blocks.block_size,
            num_cached_blocks=blocks.num_cached_blocks,
            pins=blocks.pin_stats.copy(),
            kv_block_bytes=self.engine.kv_block_bytes,
            kv_pool_bytes=pool_bytes,
            kv_resident_bytes=resident_bytes,
        )

    # The engine thread -------------------------------------------------------------------------------

    def _warm_up(self) -> None:
        if not self.ready.is_set():
            self.warmup_report = warm_up(self.engine)
            self.ready.set()

    def _deliver(self, items: list[tuple[str, object]]) -> None:
        """(request id, output or error) pairs to their streams, one hand-off per event loop: a step's outputs
        wake each loop once, not once per request."""
        batches: dict[asyncio.AbstractEventLoop, list] = {}
        for request_id, item in items:
            target = self._streams.get(request_id)
            if target is not None:
                loop, stream = target
                batches.setdefault(loop, []).append((stream, item))
        for loop, pairs in batches.items():
            loop.call_soon_threadsafe(_put_all, pairs)

    @property
    def busy(self) -> bool:
        """Has work to step: unfinished requests, and no failure."""
        return self.error is None and self.engine.has_unfinished_requests()

    def _apply(self, command: EngineRequest | Abort) -> None:
        if self.error is not None:  # sent before the failure was seen: its stream gets the failure, not silence
            if isinstance(command, EngineRequest):
                self._deliver([(command.request_id, RuntimeError(f"engine failed: {self.error!r}"))])
            return
        if isinstance(command, EngineRequest):
            try:
                self.engine.enqueue(command)
            except ValueError as error:  # its id is in use
                self._deliver([(command.request_id, error)])
        else:
            output = self.engine.abort(command.request_id)
            if output is not None:
                for listener in self._step_listeners:
                    listener(None, [output])
                self._deliver([(command.request_id, output)])

    def _step(self) -> None:
        # Listeners (metrics) before delivery: a client that has its response finds its step in /metrics. The other
        # way round, a busy machine let a test read /dashboard/data between the two and miss the last step.
        previous = self.engine.last_step
        outputs = self.engine.step()
        if self.engine.last_step is not previous:
            for listener in self._step_listeners:
                listener(self.engine.last_step, outputs)
        self._deliver([(output.request_id, output) for output in outputs])

    def _fail(self, error: BaseException) -> None:
        self.error = error
        self._deliver([(request_id, RuntimeError(f"engine failed: {error!r}")) for request_id in list(self._streams)])


def _put_all(pairs: list[tuple[asyncio.Queue, object]]) -> None:
    for stream, item in pairs:
        stream.put_nowait(item)
