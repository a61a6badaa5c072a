"""The Batch API's store shared by replicas through PostgreSQL (started by the suite: conftest.postgres_server):
one files folder, metadata in the database, and each batch run by exactly one server."""

import asyncio
import io
import time
from collections import Counter

import pytest
from batch_fakes import EchoEndpoint, request_line
from test_batch_runner import TERMINAL, all_custom_ids, make_batch, new_runner, wait_for

from carpool.postgres import connect_postgres
from carpool.server.batch import runner as batch_runner
from carpool.server.batch import store as batch_store
from carpool.server.batch.home import BatchDirUnusable, claim_batch_dir, default_batch_dir
from carpool.server.batch.store import BatchStore


@pytest.fixture
def stores(tmp_path, postgres_url):
    """Two replicas' stores: one database, one shared batch dir."""
    opened = [BatchStore(tmp_path, postgres_url) for _ in range(2)]
    yield opened
    for store in opened:
        store.close()


def test_files_batches_and_results_are_shared(stores, tmp_path):
    first, second = stores
    assert not (tmp_path / "batches.db").exists()  # the metadata is in PostgreSQL
    upload = first.save_file("tenant-a", "in.jsonl", "batch", io.BytesIO(b"{}\n"), 1 << 20, int(time.time()))
    assert second.get_file(upload["id"])["bytes"] == 3 and second.file_path(upload["id"]).read_bytes() == b"{}\n"
    files, more = second.list_files("tenant-a", False, "batch", None, 10, newest_first=True)
    assert [f["id"] for f in files] == [upload["id"]] and not more
    assert second.list_files("tenant-b", False, None, None, 10, newest_first=True) == ([], False)
    assert second.list_files(None, False, None, None, 10, newest_first=True) == ([], False)
    batch_id = make_batch(first, [request_line("a", "x")])
    assert second.active_batch_ids() == [batch_id]
    assert first.add_result(batch_id, 1, "a", True, {"custom_id": "a"})
    assert not second.add_result(batch_id, 1, "a", True, {"custom_id": "a"})  # answered once, whoever tries
    assert second.answered_lines(batch_id) == {1} and second.get_batch(batch_id)["completed"] == 1
    assert first.transition(batch_id, "in_progress", int(time.time()), ("validating",))
    assert not second.transition(batch_id, "in_progress", int(time.time()), ("validating",))


def test_a_batch_is_claimed_by_one_server_until_it_lets_go_or_its_lease_lapses(
    monkeypatch, stores, tmp_path, postgres_url
):
    first, second = stores
    batch_id = make_batch(first, [request_line("a", "x")])
    assert first.claim(batch_id) and not second.claim(batch_id)
    first.release(batch_id)
    monkeypatch.setattr(batch_store, "CLAIM_SECONDS", 0.5)
    assert second.claim(batch_id) and not first.claim(batch_id)
    claimed = time.monotonic()
    # The second server is killed: nothing renews its lease, which lapses, and only then is the batch free.
    while not first.claim(batch_id):
        assert time.monotonic() - claimed < 5
        time.sleep(0.01)
    assert time.monotonic() - claimed > 0.4
    assert second.renew_claims([batch_id], horizon=0) == [batch_id]  # it knows it lost the batch
    first.close()  # a server that closes hands its batches on at once
    assert second.claim(batch_id)
    stores[0] = BatchStore(tmp_path, postgres_url)


def test_two_servers_started_on_one_batch_run_each_line_once(stores):
    endpoints = [EchoEndpoint(delay=0.01), EchoEndpoint(delay=0.01)]
    batch_id = make_batch(stores[0], [request_line(f"r{i}", f"p{i}") for i in range(20)])

    async def scenario():
        runners = [new_runner(store, endpoint) for store, endpoint in zip(stores, endpoints, strict=True)]
        for runner in runners:
            await runner.start()  # each picks up every unfinished batch it can claim
        batch = await wait_for(stores[1], batch_id, TERMINAL)
        for runner in runners:
            await runner.stop()
        return batch

    batch = asyncio.run(scenario())
    assert batch["status"] == "completed" and batch["completed"] == 20
    assert sorted(len(endpoint.started) for endpoint in endpoints) == [0, 20]  # one server ran all of it
    assert all_custom_ids(stores[0], batch) == sorted(f"r{i}" for i in range(20))


def test_a_dead_servers_batch_is_resumed_by_another(monkeypatch, stores, tmp_path, postgres_url):
    monkeypatch.setattr(batch_runner, "ADOPT_SECONDS", 0.1)
    doomed, survivor = stores
    slow, fast = EchoEndpoint(delay=0.2), EchoEndpoint()
    batch_id = make_batch(doomed, [request_line(f"r{i}", f"p{i}") for i in range(12)])

    async def scenario():
        dying, rescuer = new_runner(doomed, slow, max_in_flight=2), new_runner(survivor, fast)
        await dying.start()
        await rescuer.start()  # both live: the batch is the first's
        while len(slow.finished) < 2:
            await asyncio.sleep(0.01)
        assert not fast.started
        await dying.stop()  # what `kill -9` leaves: lines in flight unanswered, the claim's connection gone
        doomed.close()
        batch = await wait_for(survivor, batch_id, TERMINAL)  # the survivor's next look finds it free
        await rescuer.stop()
        return batch

    batch = asyncio.run(scenario())
    stores[0] = BatchStore(tmp_path, postgres_url)
    assert batch["status"] == "completed" and batch["completed"] == 12
    assert len(slow.finished) + len(fast.started) >= 12 and set(fast.started) <= {f"p{i}" for i in range(12)}
    assert all_custom_ids(survivor, batch) == sorted(f"r{i}" for i in range(12))


def test_a_cancel_sent_to_another_replica_stops_the_batch(monkeypatch, stores):
    monkeypatch.setattr(batch_runner, "ADOPT_SECONDS", 0.05)
    running, other = stores
    endpoint = EchoEndpoint(delay=0.1)
    batch_id = make_batch(running, [request_line(f"r{i}", f"p{i}") for i in range(40)])

    async def scenario():
        runner, other_runner = new_runner(running, endpoint, max_in_flight=1), new_runner(other, EchoEndpoint())
        await runner.start()
        await other_runner.start()
        while not endpoint.finished:
            await asyncio.sleep(0.01)
        # what the other replica's POST /v1/batches/{id}/cancel does
        assert other.transition(batch_id, "cancelling", int(time.time()), ("validating", "in_progress"))
        other_runner.cancel(batch_id)
        batch = await wait_for(other, batch_id, {"cancelled"}, timeout=5)
        for each in (runner, other_runner):
            await each.stop()
        return batch

    batch = asyncio.run(scenario())
    assert batch["completed"] < 40 and batch["completed"] + batch["failed"] == 40


def test_replicas_share_a_postgres_databases_batch_dir(tmp_path, postgres_url):
    """No dir lock between servers of one PostgreSQL database; a SQLite database's server still may not use it."""
    locks = [claim_batch_dir(tmp_path / "shared", postgres_url) for _ in range(2)]
    for lock in locks:
        lock.close()
    with pytest.raises(BatchDirUnusable, match="holds the batches of the database postgresql://"):
        claim_batch_dir(tmp_path / "shared", tmp_path / "carpool.db")
    assert default_batch_dir(postgres_url).name.startswith("postgres-")


def drop_session(store: BatchStore, postgres_url: str) -> None:
    """What a database restart does to a server: its session ends (the others are left alone here)."""
    killer = connect_postgres(postgres_url)
    pid = store._conn.raw.info.backend_pid
    killer.execute("SELECT pg_terminate_backend(?)", (pid,))
    while killer.execute("SELECT COUNT(*) FROM pg_stat_activity WHERE pid = ?", (pid,)).fetchone()[0]:
        time.sleep(0.01)
    killer.close()


def test_a_dropped_session_keeps_the_servers_leases(stores, postgres_url):
    first, second = stores
    batch_id = make_batch(first, [request_line("a", "x")])
    assert first.claim(batch_id)
    drop_session(first, postgres_url)
    assert not second.claim(batch_id)  # a lease is a row: it outlives the session that wrote it
    assert first.renew_claims([batch_id], horizon=0) == []  # renewed over a new session
    assert not second.claim(batch_id)


class SharedLines:
    """Every line both servers' endpoints run, and any line that ran on both at once."""

    def __init__(self):
        self.running: set[str] = set()
        self.overlaps: list[str] = []
        self.stopped_for_rerun: list[bool] = []  # per line stopped mid-run: whether it was left for a rerun


class TrackedEndpoint(EchoEndpoint):
    def __init__(self, lines: SharedLines, delay: float):
        super().__init__(delay)
        self.lines = lines

    async def run(self, principal, body: dict, line=None):
        prompt = body["prompt"]
        if prompt in self.lines.running:
            self.lines.overlaps.append(prompt)
        self.lines.running.add(prompt)
        try:
            return await super().run(principal, body, line)
        except asyncio.CancelledError:
            self.lines.stopped_for_rerun.append(line.rerun_later())
            raise
        finally:
            self.lines.running.discard(prompt)


def test_a_line_is_run_and_billed_once_when_the_first_servers_session_is_lost(monkeypatch, stores, postgres_url):
    """Each line started is a request billed (an aborted one too, for the tokens it used): with a session lock the
    second server took the batch the moment the first's session dropped and ran its in-flight lines again."""
    monkeypatch.setattr(batch_runner, "ADOPT_SECONDS", 0.1)
    first, second = stores
    lines = SharedLines()
    slow, fast = TrackedEndpoint(lines, delay=0.2), TrackedEndpoint(lines, delay=0.0)
    prompts = [f"p{i}" for i in range(10)]
    batch_id = make_batch(first, [request_line(f"r{i}", prompt) for i, prompt in enumerate(prompts)])

    async def scenario():
        owner, other = new_runner(first, slow, max_in_flight=2), new_runner(second, fast)
        await owner.start()
        await other.start()
        while len(slow.finished) < 2:
            await asyncio.sleep(0.01)
        drop_session(first, postgres_url)
        batch = await wait_for(first, batch_id, TERMINAL)
        for runner in (owner, other):
            await runner.stop()
        return batch

    batch = asyncio.run(scenario())
    assert batch["status"] == "completed" and batch["completed"] == 10
    assert Counter(slow.started + fast.started) == Counter(prompts) and not lines.overlaps


def test_a_server_that_cannot_renew_stops_before_its_lease_lapses(monkeypatch, stores, postgres_url):
    """The database is unreachable from the first server only (its session dropped, and it reconnects to a closed
    port): it stops the batch before the lease can lapse, and the second resumes it after; no line runs on both."""
    monkeypatch.setattr(batch_runner, "ADOPT_SECONDS", 0.2)  # it stops 0.4 s (two looks) before the lease lapses
    monkeypatch.setattr(batch_store, "CLAIM_SECONDS", 2.0)
    first, second = stores
    lines = SharedLines()
    # Its lines outlast the lease: only the lease's own deadline can stop them in time.
    cut_off, healthy = TrackedEndpoint(lines, delay=5.0), TrackedEndpoint(lines, delay=0.0)
    batch_id = make_batch(first, [request_line(f"r{i}", f"p{i}") for i in range(10)])

    async def scenario():
        owner, other = new_runner(first, cut_off, max_in_flight=2), new_runner(second, healthy)
        await owner.start()
        await other.start()
        while len(cut_off.started) < 2:
            await asyncio.sleep(0.01)
        first._conn.url = f"postgresql://nobody@127.0.0.1:{closed_port()}/none"
        drop_session(first, postgres_url)
        batch = await wait_for(second, batch_id, TERMINAL)
        stopped = batch_id not in owner._tasks
        for runner in (owner, other):
            await runner.stop()
        return batch, stopped

    batch, stopped = asyncio.run(scenario())
    assert stopped and healthy.started  # the first let go; the second ran the rest
    # The lines the first stopped were left for the rerun, so their work is not billed (ServingEndpoint.run).
    assert lines.stopped_for_rerun == [True, True]
    assert batch["status"] == "completed" and batch["completed"] == 10 and not lines.overlaps


def closed_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_a_runner_that_lost_its_lease_stops_running_the_batch(monkeypatch, stores, postgres_url):
    monkeypatch.setattr(batch_runner, "ADOPT_SECONDS", 0.2)
    first, second = stores
    slow = EchoEndpoint(delay=0.05)
    batch_id = make_batch(first, [request_line(f"r{i}", f"p{i}") for i in range(200)])

    async def scenario():
        runner = new_runner(first, slow, max_in_flight=1)
        await runner.start()
        while not slow.finished:
            await asyncio.sleep(0.01)
        second._conn.execute("UPDATE batch_claims SET expires_at = 0")  # lapsed (a server stalled past its lease)
        assert second.claim(batch_id)  # another server takes it before the runner looks again
        deadline = time.monotonic() + 5
        while batch_id in runner._tasks and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        stopped = batch_id not in runner._tasks
        await runner.stop()
        return stopped

    assert asyncio.run(scenario())
    assert len(slow.started) < 200
