"""The runner against a fake endpoint: lifecycle, bounded in-flight work, cancel, expiry and resume after a stop."""

import asyncio
import io
import json
import threading
import time
from collections.abc import Awaitable, Callable

from batch_fakes import EchoEndpoint, request_line

from carpool.server.batch.limits import BatchLimits
from carpool.server.batch.runner import BatchRunner
from carpool.server.batch.store import BatchStore

TERMINAL = {"completed", "failed", "expired", "cancelled"}


def make_batch(store: BatchStore, lines: list[str], window: int = 3600, key_id: str | None = "key-a") -> str:
    data = "".join(line + "\n" for line in lines).encode()
    file = store.save_file("tenant-a", "input.jsonl", "batch", io.BytesIO(data), 1 << 20, int(time.time()))
    now = int(time.time())
    batch = store.create_batch(
        owner="tenant-a",
        key_id=key_id,
        tenant="tenant-a",
        endpoint="/v1/completions",
        input_file_id=file["id"],
        completion_window="24h",
        metadata=None,
        created_at=now,
        expires_at=now + window,
    )
    return batch["id"]


async def wait_for(store: BatchStore, batch_id: str, statuses: set[str], timeout: float = 20) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        batch = store.get_batch(batch_id)
        if batch["status"] in statuses:
            return batch
        await asyncio.sleep(0.01)
    raise AssertionError(f"batch still {store.get_batch(batch_id)['status']}")


def result_lines(store: BatchStore, file_id: str | None) -> list[dict]:
    if file_id is None:
        return []
    return [json.loads(line) for line in store.file_path(file_id).read_text().splitlines()]


def all_custom_ids(store: BatchStore, batch: dict) -> list[str]:
    lines = result_lines(store, batch["output_file_id"]) + result_lines(store, batch["error_file_id"])
    return sorted(line["custom_id"] for line in lines)


def new_runner(store, endpoint, max_in_flight=4) -> BatchRunner:
    return BatchRunner(store, {"/v1/completions": endpoint}, BatchLimits(), max_in_flight)


def test_batch_completes_with_bounded_work_in_flight_on_behalf_of_its_owner(tmp_path):
    store, endpoint = BatchStore(tmp_path), EchoEndpoint(delay=0.01)
    batch_id = make_batch(store, [request_line(f"r{i}", f"p{i}") for i in range(12)])

    async def scenario():
        runner = new_runner(store, endpoint, max_in_flight=3)
        await runner.start()
        runner.submit(batch_id)
        return await wait_for(store, batch_id, TERMINAL)

    batch = asyncio.run(scenario())
    assert batch["status"] == "completed"
    assert (batch["total"], batch["completed"], batch["failed"]) == (12, 12, 0)
    assert batch["in_progress_at"] and batch["finalizing_at"] and batch["completed_at"]
    assert batch["error_file_id"] is None
    output = result_lines(store, batch["output_file_id"])
    assert sorted(line["custom_id"] for line in output) == sorted(f"r{i}" for i in range(12))
    first = next(line for line in output if line["custom_id"] == "r1")
    assert first["response"]["status_code"] == 200 and first["response"]["body"]["text"] == "1p"
    assert first["id"].startswith("batch_req_") and first["error"] is None
    assert endpoint.peak_in_flight == 3
    assert {(p.key_id, p.tenant) for p in endpoint.principals} == {("key-a", "tenant-a")}  # billed to its owner
    assert (batch["input_tokens"], batch["cached_tokens"], batch["output_tokens"]) == (36, 12, 24)


def test_a_request_the_endpoint_refuses_goes_to_the_error_file(tmp_path):
    store, endpoint = BatchStore(tmp_path), EchoEndpoint()
    batch_id = make_batch(store, [request_line("good", "hi"), request_line("bad", "too long")])

    async def scenario():
        runner = new_runner(store, endpoint)
        await runner.start()
        runner.submit(batch_id)
        return await wait_for(store, batch_id, TERMINAL)

    batch = asyncio.run(scenario())
    assert batch["status"] == "completed"
    assert (batch["completed"], batch["failed"]) == (1, 1)
    (error,) = result_lines(store, batch["error_file_id"])
    assert error["custom_id"] == "bad" and error["response"]["status_code"] == 400
    assert error["response"]["body"]["error"]["message"] == "prompt too long"
    assert (batch["input_tokens"], batch["output_tokens"]) == (3, 2)  # the refused request used nothing


def test_invalid_lines_fail_the_batch_before_anything_runs(tmp_path):
    store, endpoint = BatchStore(tmp_path), EchoEndpoint()
    lines = [
        request_line("a", "fine"),
        "{not json",
        json.dumps({"method": "POST", "url": "/v1/completions", "body": {"prompt": "x"}}),
        request_line("a", "duplicate"),
        request_line("b", "wrong url", url="/v1/chat/completions"),
        json.dumps({"custom_id": "c", "method": "POST", "url": "/v1/completions", "body": {"prompt": 5}}),
    ]
    batch_id = make_batch(store, lines)

    async def scenario():
        runner = new_runner(store, endpoint)
        await runner.start()
        runner.submit(batch_id)
        return await wait_for(store, batch_id, TERMINAL)

    batch = asyncio.run(scenario())
    assert batch["status"] == "failed" and batch["failed_at"]
    errors = json.loads(batch["errors"])
    assert [(e["line"], e["code"]) for e in errors] == [
        (2, "invalid_json_line"),
        (3, "missing_required_parameter"),
        (4, "duplicate_custom_id"),
        (5, "invalid_url"),
        (6, "invalid_request"),
    ]
    assert errors[4]["param"] == "body.prompt"
    assert endpoint.started == []


def test_cancel_keeps_finished_results_and_answers_the_rest_as_cancelled(tmp_path):
    store, endpoint = BatchStore(tmp_path), EchoEndpoint(delay=0.05)
    batch_id = make_batch(store, [request_line(f"r{i}", f"p{i}") for i in range(20)])

    async def scenario():
        runner = new_runner(store, endpoint, max_in_flight=2)
        await runner.start()
        runner.submit(batch_id)
        # Recorded, not only run: the runner writes results off the event loop, a moment after each line ends.
        while store.get_batch(batch_id)["completed"] < 4:
            await asyncio.sleep(0.01)
        assert store.transition(batch_id, "cancelling", int(time.time()), ("validating", "in_progress"))
        runner.cancel(batch_id)
        return await wait_for(store, batch_id, TERMINAL)

    batch = asyncio.run(scenario())
    assert batch["status"] == "cancelled" and batch["cancelling_at"] and batch["cancelled_at"]
    output = result_lines(store, batch["output_file_id"])
    errors = result_lines(store, batch["error_file_id"])
    assert 4 <= len(output) < 20
    assert all(line["error"]["code"] == "batch_cancelled" and line["response"] is None for line in errors)
    assert all_custom_ids(store, batch) == sorted(f"r{i}" for i in range(20))
    assert len(endpoint.started) < 20
    assert (batch["completed"], batch["failed"]) == (len(output), len(errors))


def test_unfinished_requests_expire_with_error_lines_past_the_window(tmp_path):
    store, endpoint = BatchStore(tmp_path), EchoEndpoint(delay=0.2)
    batch_id = make_batch(store, [request_line(f"r{i}", f"p{i}") for i in range(30)], window=1)

    async def scenario():
        runner = new_runner(store, endpoint, max_in_flight=2)
        await runner.start()
        runner.submit(batch_id)
        return await wait_for(store, batch_id, TERMINAL)

    batch = asyncio.run(scenario())
    assert batch["status"] == "expired" and batch["expired_at"]
    errors = result_lines(store, batch["error_file_id"])
    assert errors and all(line["error"]["code"] == "batch_expired" for line in errors)
    assert all_custom_ids(store, batch) == sorted(f"r{i}" for i in range(30))


async def run_then_stop(store, endpoint, batch_id: str, max_in_flight: int, until: Callable[[], Awaitable]) -> None:
    """Run the batch until `until()` returns, then stop the runner."""
    runner = new_runner(store, endpoint, max_in_flight=max_in_flight)
    await runner.start()
    runner.submit(batch_id)
    await until()
    await runner.stop()


def test_a_stopped_runner_resumes_and_answers_every_custom_id_once(tmp_path):
    endpoint = EchoEndpoint(delay=0.02)
    store = BatchStore(tmp_path)
    batch_id = make_batch(store, [request_line(f"r{i}", f"p{i}") for i in range(16)])

    async def five_finished():
        while len(endpoint.finished) < 5:
            await asyncio.sleep(0.005)

    asyncio.run(run_then_stop(store, endpoint, batch_id, 2, five_finished))
    store.close()
    assert BatchStore(tmp_path).get_batch(batch_id)["status"] == "in_progress"
    finished_before = len(endpoint.finished)

    store = BatchStore(tmp_path)

    async def second_life():
        runner = new_runner(store, endpoint)
        await runner.start()  # picks the batch up without being told
        return await wait_for(store, batch_id, TERMINAL)

    batch = asyncio.run(second_life())
    assert batch["status"] == "completed"
    assert all_custom_ids(store, batch) == sorted(f"r{i}" for i in range(16))
    assert len(endpoint.finished) - finished_before <= 16 - 5  # finished lines were not run again
    assert batch["completed"] == 16


class SlowWritingStore(BatchStore):
    """Takes its time storing a result, and says when a write has begun."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.writing = threading.Event()

    def add_result(self, *args, **kwargs) -> bool:
        self.writing.set()
        time.sleep(0.3)
        return super().add_result(*args, **kwargs)


def test_a_stop_during_a_result_write_waits_for_it_so_the_billed_line_is_not_run_again(tmp_path):
    endpoint = EchoEndpoint(delay=0.01)
    store = SlowWritingStore(tmp_path)
    batch_id = make_batch(store, [request_line(f"r{i}", f"p{i}") for i in range(4)])

    async def a_write_began():
        await asyncio.to_thread(store.writing.wait, 10)

    async def stopped_while_writing():
        await run_then_stop(store, endpoint, batch_id, 1, a_write_began)
        return store.answered_lines(batch_id)  # read before asyncio.run's end, which waits for the writing thread

    answered = asyncio.run(stopped_while_writing())
    assert answered == set(range(1, len(endpoint.finished) + 1)) and answered


class LoopWatchingStore(BatchStore):
    """Notes each call made on an event loop's thread, claims aside (they stay on the loop)."""

    ON_LOOP_ALLOWED = frozenset({"claim", "renew_claims", "release", "file_path", "close"})

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.on_loop: list[str] = []

    def __getattribute__(self, name):
        attribute = super().__getattribute__(name)
        if name.startswith("_") or name in LoopWatchingStore.ON_LOOP_ALLOWED or not callable(attribute):
            return attribute

        def watched(*args, **kwargs):
            try:
                asyncio.get_running_loop()
                self.on_loop.append(name)
            except RuntimeError:  # a worker thread: no loop runs here
                pass
            return attribute(*args, **kwargs)

        return watched


def test_the_runner_calls_the_store_off_the_event_loop(tmp_path):
    store = LoopWatchingStore(tmp_path)
    batch_id = make_batch(store, [request_line(f"r{i}", f"p{i}") for i in range(3)])
    cancelled_id = make_batch(store, [request_line(f"r{i}", f"p{i}") for i in range(3)])
    reader = BatchStore(tmp_path)  # the test's own reads, on the loop, are not the runner's
    endpoint = EchoEndpoint(delay=0.05)

    async def scenario():
        runner = new_runner(store, endpoint, max_in_flight=2)
        await runner.start()  # resumes both
        await wait_for(reader, batch_id, TERMINAL)
        store.transition(cancelled_id, "cancelling", int(time.time()), ("validating", "in_progress"))
        runner.cancel(cancelled_id)
        await wait_for(reader, cancelled_id, TERMINAL)
        await runner.stop()

    store.on_loop.clear()
    asyncio.run(scenario())
    assert store.on_loop == ["transition"]  # the test's own cancel, above: nothing of the runner's
