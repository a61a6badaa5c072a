"""`carpool serve --replicas 1:2` on a local Ray: load scales the model's deployment from 1 replica to 2 (Ray
Serve's autoscaler, under carpool's policy), and when the load goes the replica Serve removes finishes the stream it
holds first: a long streamed answer on the removed replica arrives whole."""

import json
import threading
import time

import httpx
import pytest
from live_server import LiveServer

pytest.importorskip("ray.serve", reason="needs `make scale`")

SLOTS = 2  # --max-num-seqs: the autoscaler's target of ongoing requests per replica
LONG_TOKENS = 1000


@pytest.fixture(scope="module")
def server():
    # 1 s of low load before a scale-down would be as good a test and flakier on a loaded machine; 5 s keeps it short.
    live = LiveServer(
        "--replicas", "1:2", "--num-threads", "1", "--max-num-seqs", str(SLOTS), "--scale-down-delay", "5"
    )
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


def wait_for(condition, seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.5)


def test_load_adds_a_replica_and_a_stream_on_the_removed_one_finishes_whole(server):
    assert serving(server) == 1
    (first,) = running(server)
    body = {"prompt": "Once upon a time", "max_tokens": 200, "ignore_eos": True}
    # Three times the one replica's slots: Ray's total of ongoing requests over its target asks for a second.
    answers = []

    def post():
        answers.append(httpx.post(server.url + "/v1/completions", json=body, timeout=300))

    load = [threading.Thread(target=post) for _ in range(3 * SLOTS)]
    for thread in load:
        thread.start()
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
        wait_for(lambda: "Removing 1 replica" in server.output(), 60, "the idle replica was not removed")
        assert running(server)[second] == 1  # draining, still posting
        events = [line.removeprefix("data: ") for line in lines if line.startswith("data:")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(event) for event in events[:-1]]
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"
    assert chunks[-1]["usage"]["completion_tokens"] == LONG_TOKENS
    wait_for(lambda: serving(server) == 1, 30, "the drained replica did not leave")
    assert set(running(server)) == {first}  # the stream's replica went
