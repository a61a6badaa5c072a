"""`carpool serve --replicas 1:2` on a local Ray: load scales the model's deployment from 1 replica to 2 (Ray
Serve's autoscaler, under carpool's policy), and when the load goes the replica Serve removes finishes the stream it
holds first: a long streamed answer on the removed replica arrives whole."""

import json
import shutil
import threading
import time
from pathlib import Path

import httpx
import pytest
from live_server import LiveServer

pytest.importorskip("ray.serve", reason="needs `make scale`")

SLOTS = 2  # --max-num-seqs: the autoscaler's target of ongoing requests per replica
LONG_TOKENS = 3000  # >= 15 s at one thread (~200 tokens/s alone): past the scale-down, ~10 s after the load ends
FAILED_START = "model: no such file or directory"  # the new replica's constructor, in Ray's log


AUTOSCALED = ("--replicas", "1:2", "--num-threads", "1", "--max-num-seqs", str(SLOTS), "--scale-down-delay", "5")


@pytest.fixture
def server():
    live = LiveServer(*AUTOSCALED)
    yield live
    live.stop()


def running(server) -> dict[str, float]:
    """{replica: requests running there}, as the replicas last posted them."""
    return {
        dict(labels)["replica"]: value
        for (sample, labels), value in server.metrics().items()
        if sample == "carpool:num_requests_running" and "replica" in dict(labels)
    }


def serving(server) -> float:
    return next(value for (name, _), value in server.metrics().items() if name == "carpool:replicas")


def log(server) -> str:
    """The server's whole log, Ray Serve's controller's lines included (LiveServer.output keeps only the tail)."""
    return Path(server.log.name).read_text()


def wait_for(condition, seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.5)


def start_load(server, requests: int, body: dict) -> tuple[list, list[threading.Thread]]:
    """`requests` completions at once, each on a thread: (their answers as they come, the threads)."""
    answers = []

    def post():
        answers.append(httpx.post(server.url + "/v1/completions", json=body, timeout=300))

    load = [threading.Thread(target=post) for _ in range(requests)]
    for thread in load:
        thread.start()
    return answers, load


def test_load_adds_a_replica_and_a_stream_on_the_removed_one_finishes_whole(server):
    assert serving(server) == 1
    (first,) = running(server)
    body = {"prompt": "Once upon a time", "max_tokens": 200, "ignore_eos": True}
    # Five times the one replica's slots: Ray's total of ongoing requests over its target asks for a second. Five
    # waves, so the load outlasts Ray's decision on a faster machine too (on this 2-core VM: the second replica
    # seen at 7.2 s with 2 of 6 answers done, the last of 6 at 12.3 s; the 3,000-token stream then ran 52 s).
    answers, load = start_load(server, 5 * SLOTS, body)
    wait_for(lambda: serving(server) == 2, 120, "the load did not add a replica")
    (second,) = set(running(server)) - {first}

    long = body | {"max_tokens": LONG_TOKENS, "stream": True, "stream_options": {"include_usage": True}}
    with (
        httpx.Client(base_url=server.url, timeout=300) as http,
        http.stream("POST", "/v1/completions", json=long) as response,
    ):
        lines = response.iter_lines()
        assert next(line for line in lines if line.startswith("data:"))
        # Ray's router sends it to the idle new replica (the first still works through the load); the newest is
        # also the one Serve removes first when it scales down.
        wait_for(lambda: running(server).get(second) == 1, 5, "the stream is not on the new replica")
        for thread in load:
            thread.join()
        assert [answer.status_code for answer in answers] == [200] * len(load)
        # The load is gone; the scale-down starts while the stream still runs on the replica it removes.
        wait_for(lambda: "Removing 1 replica" in log(server), 60, "the idle replica was not removed")
        assert running(server)[second] == 1  # draining, still posting
        events = [line.removeprefix("data: ") for line in lines if line.startswith("data:")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(event) for event in events[:-1]]
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"
    assert chunks[-1]["usage"]["completion_tokens"] == LONG_TOKENS
    wait_for(lambda: serving(server) == 1, 30, "the drained replica did not leave")
    assert set(running(server)) == {first}  # the stream's replica went


def test_a_replica_that_fails_to_start_takes_no_traffic_and_is_replaced(tmp_path):
    from carpool.models.catalog import resolve

    model = tmp_path / Path(resolve(None)).name
    shutil.copy(resolve(None), model)
    server = LiveServer("--model", str(model), *AUTOSCALED)
    try:
        (first,) = running(server)
        away = model.rename(model.with_suffix(".away"))  # the first replica has it mapped; a new one cannot load it
        body = {"prompt": "Once upon a time", "max_tokens": 300, "ignore_eos": True}
        answers, load = start_load(server, 4 * SLOTS, body)
        wait_for(lambda: FAILED_START in log(server), 120, "no replica was started and failed")
        for _ in range(6):  # Serve retries it meanwhile; none joins, and the load keeps being answered by the first
            assert set(running(server)) == {first} and serving(server) == 1
            time.sleep(0.5)
        away.rename(model)
        wait_for(lambda: serving(server) == 2, 120, "no replica replaced the one that failed")
        for thread in load:
            thread.join()
        assert [answer.status_code for answer in answers] == [200] * len(load)
    finally:
        server.stop()


def test_a_capacity_plan_starts_its_replicas_before_any_load(tmp_path):
    # The plan wants 2 replicas this minute and the next ten: Ray's controller runs PlannedPolicy with the file.
    now = time.time() // 60 * 60
    plan = tmp_path / "plan.json"
    minutes = [{"at": now + 60 * i, "replicas": 2} for i in range(-1, 10)]
    plan.write_text(json.dumps({"minutes": minutes, "replica_start_seconds": 45}))
    server = LiveServer(*AUTOSCALED, "--capacity-plan", str(plan))
    try:
        wait_for(lambda: serving(server) == 2, 120, "the plan's second replica did not start")
        assert list(running(server).values()) == [0, 0]  # no load asked for it
    finally:
        server.stop()
