"""BatchRunner: drives every unfinished batch through validation, execution and finalization in the server process.

Requests go through the live endpoints' own code at the batch tier, the lowest, so the scheduler preempts them
first and they only fill room interactive traffic leaves; that code also bills each one to the batch's owner.
At most `max_in_flight` batch requests exist at once, across all batches: the input file is read a line at a
time as slots free up, never loaded whole. Each result is stored as its request finishes; on restart a batch
resumes from the lines without one.

Lifecycle: validating -> in_progress -> finalizing -> completed, or validating -> failed (bad input),
in_progress -> expired (past the completion window), validating|in_progress -> cancelling -> cancelled.
Lines still unanswered at expiry or cancellation get an error line each (`batch_expired`, `batch_cancelled`),
so every custom_id appears exactly once in the output or error file.

The store's reads and writes run on worker threads (asyncio.to_thread), never on the event loop: on PostgreSQL
each is a round trip that a slow or unreachable database would otherwise make every stream wait on. Only claims
(claim, release, and the adopter's renewal) stay on the loop, where the runner's own bookkeeping needs them.

A batch runs only while this server holds its claim (BatchStore.claim). On a store shared by replicas the runner
looks again every ADOPT_SECONDS: it renews the leases of the batches it runs (stopping any it lost, or may lose
before it can renew again), resumes unfinished batches nobody holds (their server died), and notices a
cancellation another replica's API wrote for a batch it runs.
"""

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

from carpool.economics.contract import Principal
from carpool.server.batch.limits import BatchLimits
from carpool.server.batch.store import BatchStore, new_id
from carpool.server.batch.validation import InvalidLine, iter_lines, parse_line, validate_file
from carpool.server.errors import error_body

log = logging.getLogger(__name__)
ADOPT_SECONDS = 5.0


@dataclass
class Outcome:
    """What a live call to the endpoint would have answered, and the tokens it used (for the batch's usage)."""

    status_code: int
    body: dict
    request_id: str
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0


@dataclass
class LineRun:
    """One run of a batch line, as its endpoint sees it."""

    request_id: str  # a new one each run: its ledger row's, and the output line's response.request_id
    # Whether a cancellation now means another run will answer the line (this server stops, or lost the batch's
    # lease): the work is then not billed, as the rerun will be.
    rerun_later: Callable[[], bool]


class BatchEndpoint(Protocol):
    def check_body(self, body: dict) -> None: ...  # raises InvalidBody

    async def run(self, principal: Principal, body: dict, line: LineRun) -> Outcome: ...


class BatchRunner:
    def __init__(
        self,
        store: BatchStore,
        endpoints: dict[str, BatchEndpoint],
        limits: BatchLimits,
        max_in_flight: int,
        clock: Callable[[], float] = time.time,
    ):
        self.store, self.endpoints, self.limits, self.clock = store, endpoints, limits, clock
        self.max_in_flight = max_in_flight
        self._slots: asyncio.Semaphore | None = None
        self._tasks: dict[str, asyncio.Task] = {}
        self._cancel_requested: dict[str, asyncio.Event] = {}
        self._rerun_later: set[str] = set()  # batches stopped here for another run (LineRun.rerun_later)
        self._adopter: asyncio.Task | None = None

    # Lifecycle ---------------------------------------------------------------------------------------

    async def start(self) -> None:
        """Pick up every batch a previous process left unfinished."""
        self._slots = asyncio.Semaphore(self.max_in_flight)
        for batch_id in await asyncio.to_thread(self.store.active_batch_ids):
            self.submit(batch_id)
        if self.store.shared:
            self._adopter = asyncio.create_task(self._adopt(), name="batch adopter")

    async def _adopt(self) -> None:
        while True:
            await asyncio.sleep(ADOPT_SECONDS)
            try:
                # A lease that could lapse before the next look (with one look's time to spare) stops its batch now.
                for batch_id in self.store.renew_claims(list(self._tasks), horizon=2 * ADOPT_SECONDS):
                    log.warning(
                        "batch %s: its lease was lost, or may lapse while the database is away: stopped "
                        "(another server resumes it)",
                        batch_id,
                    )
                    self._rerun_later.add(batch_id)
                    self._tasks[batch_id].cancel()
                for batch_id in await asyncio.to_thread(self.store.active_batch_ids):
                    if batch_id not in self._tasks:
                        self.submit(batch_id)
                    elif (await asyncio.to_thread(self.store.get_batch, batch_id))["status"] == "cancelling":
                        self._cancel_event(batch_id).set()
            except Exception:  # the database is away for now: look again next time
                log.exception("batch runner: looking for batches to resume failed")

    async def stop(self) -> None:
        """Abort what is in flight; those lines have no result yet, so the next start runs them again (a line
        already answered is not aborted: the stop waits for its result's write)."""
        self._rerun_later.update(self._tasks)
        tasks = [*self._tasks.values(), *([self._adopter] if self._adopter else [])]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def submit(self, batch_id: str) -> None:
        if batch_id in self._tasks or not self.store.claim(batch_id):
            return
        task = asyncio.create_task(self._drive(batch_id), name=f"batch {batch_id}")
        self._tasks[batch_id] = task
        task.add_done_callback(lambda _: self._forget(batch_id))

    def cancel(self, batch_id: str) -> None:
        """The store already says `cancelling`; stop the batch's work, or finish the cancellation if none runs."""
        if batch_id in self._tasks:
            self._cancel_event(batch_id).set()
        else:
            self.submit(batch_id)

    def _forget(self, batch_id: str) -> None:
        task = self._tasks.pop(batch_id)
        self._cancel_requested.pop(batch_id, None)
        self._rerun_later.discard(batch_id)
        self.store.release(batch_id)
        if not task.cancelled() and task.exception() is not None:
            log.error("batch %s stopped on an error", batch_id, exc_info=task.exception())

    def _cancel_event(self, batch_id: str) -> asyncio.Event:
        return self._cancel_requested.setdefault(batch_id, asyncio.Event())

    def _now(self) -> int:
        return int(self.clock())

    # One batch, start to end ---------------------------------------------------------------------------

    async def _drive(self, batch_id: str) -> None:
        batch = await asyncio.to_thread(self.store.get_batch, batch_id)
        if batch["status"] == "validating":
            await self._validate(batch)
            batch = await asyncio.to_thread(self.store.get_batch, batch_id)
        if batch["status"] == "in_progress":
            ending = await self._execute(batch)
            if ending == "done":
                await asyncio.to_thread(self.store.transition, batch_id, "finalizing", self._now(), ("in_progress",))
            elif ending == "expired":
                await self._answer_the_rest(batch, "batch_expired", "The batch expired before this request ran.")
                await self._close(batch_id, "expired", ("in_progress",))
            batch = await asyncio.to_thread(self.store.get_batch, batch_id)
        if batch["status"] == "finalizing":
            await self._close(batch_id, "completed", ("finalizing",))
        elif batch["status"] == "cancelling":
            await self._answer_the_rest(batch, "batch_cancelled", "The batch was cancelled before this request ran.")
            await self._close(batch_id, "cancelled", ("cancelling",))

    async def _validate(self, batch: dict) -> None:
        path = self.store.file_path(batch["input_file_id"])
        check_body = self.endpoints[batch["endpoint"]].check_body
        result = await asyncio.to_thread(validate_file, path, batch["endpoint"], check_body, self.limits)
        if result.errors:
            await asyncio.to_thread(
                self.store.transition, batch["id"], "failed", self._now(), ("validating",), errors=result.errors
            )
        else:
            await asyncio.to_thread(
                self.store.transition, batch["id"], "in_progress", self._now(), ("validating",), total=result.total
            )

    async def _execute(self, batch: dict) -> str:
        """Run the batch's unanswered lines: 'done', or 'cancelled' / 'expired' with the rest left unanswered."""
        cancelled = self._cancel_event(batch["id"])
        work = asyncio.create_task(self._dispatch(batch))
        watch = asyncio.create_task(cancelled.wait())
        try:
            window_left = max(0.0, batch["expires_at"] - self.clock())
            await asyncio.wait({work, watch}, timeout=window_left, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watch.cancel()
            if not work.done():
                work.cancel()
            await asyncio.gather(work, watch, return_exceptions=True)
        if not work.cancelled():  # it ran to the end, or failed on its own
            if work.exception() is not None:
                raise work.exception()
            return "done"
        return "cancelled" if cancelled.is_set() else "expired"

    async def _dispatch(self, batch: dict) -> None:
        answered = await asyncio.to_thread(self.store.answered_lines, batch["id"])
        principal = Principal(key_id=batch["key_id"], tenant=batch["tenant"])
        in_flight: set[asyncio.Task] = set()
        try:
            for number, raw in iter_lines(self.store.file_path(batch["input_file_id"])):
                if number in answered:
                    continue
                await self._slots.acquire()
                task = asyncio.create_task(self._run_line(batch, principal, number, raw))
                in_flight.add(task)
                # Released by a callback, not inside the task, so a task cancelled before it starts still frees it.
                task.add_done_callback(lambda done: (in_flight.discard(done), self._slots.release()))
            while in_flight:
                await asyncio.gather(*in_flight)
        finally:
            for task in in_flight:
                task.cancel()
            await asyncio.gather(*in_flight, return_exceptions=True)

    async def _run_line(self, batch: dict, principal: Principal, number: int, raw: bytes) -> None:
        endpoint = self.endpoints[batch["endpoint"]]
        line = LineRun(new_id("req_"), lambda: batch["id"] in self._rerun_later)
        try:
            request = parse_line(raw, batch["endpoint"], endpoint.check_body)
            outcome = await endpoint.run(principal, request["body"], line)
        except InvalidLine as error:  # the file changed on disk since it was validated
            body = error_body(400, error.message, error.param, error.code)
            request, outcome = {"custom_id": _custom_id(raw) or f"line-{number}"}, Outcome(400, body, line.request_id)
        except Exception:  # one request's fault must not stall the batch: its line says so, the rest go on
            log.exception("batch %s line %d failed", batch["id"], number)
            body = error_body(500, "The server had an error while processing this request.")
            request, outcome = {"custom_id": _custom_id(raw) or f"line-{number}"}, Outcome(500, body, line.request_id)
        record = {
            "id": new_id("batch_req_"),
            "custom_id": request["custom_id"],
            "response": {"status_code": outcome.status_code, "request_id": outcome.request_id, "body": outcome.body},
            "error": None,
        }
        # The line is answered (and billed): its result is stored even if the batch stops meanwhile, since a line
        # without one runs, and is billed, again at the next start.
        await _finish_despite_cancellation(
            asyncio.to_thread(
                self.store.add_result,
                batch["id"],
                number,
                request["custom_id"],
                outcome.status_code == 200,
                record,
                outcome.prompt_tokens,
                outcome.cached_tokens,
                outcome.output_tokens,
            )
        )

    # Endings -------------------------------------------------------------------------------------------

    async def _answer_the_rest(self, batch: dict, code: str, message: str) -> None:
        """An error line for every line that has no result, if the batch ever got as far as running."""
        if batch["in_progress_at"] is None:
            return
        await asyncio.to_thread(_answer_unanswered, self.store, batch, code, message)

    async def _close(self, batch_id: str, status: str, allowed_from: tuple[str, ...]) -> None:
        await asyncio.to_thread(self.store.close_batch, batch_id, status, self._now(), allowed_from)


async def _finish_despite_cancellation(work: Awaitable) -> None:
    """Await `work` to its end even when the awaiting task is cancelled meanwhile; then pass the cancellation on."""
    task = asyncio.ensure_future(work)
    cancelled = False
    while not task.done():
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            cancelled = True
    if cancelled:
        raise asyncio.CancelledError
    task.result()


def _answer_unanswered(store: BatchStore, batch: dict, code: str, message: str) -> None:
    answered = store.answered_lines(batch["id"])
    for number, raw in iter_lines(store.file_path(batch["input_file_id"])):
        if number in answered:
            continue
        custom_id = _custom_id(raw) or f"line-{number}"
        error = {"code": code, "message": message}
        record = {"id": new_id("batch_req_"), "custom_id": custom_id, "response": None, "error": error}
        store.add_result(batch["id"], number, custom_id, False, record)


def _custom_id(raw: bytes) -> str | None:
    try:
        custom_id = json.loads(raw).get("custom_id")
    except (ValueError, AttributeError):
        return None
    return custom_id if isinstance(custom_id, str) and custom_id else None
