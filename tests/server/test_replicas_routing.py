"""The router without Ray's processes: where each policy sends requests, and what a dead replica does to a
request (a batch line goes again to another replica; an interactive one already streaming fails retryably)."""

import asyncio

import pytest

pytest.importorskip("ray.serve", reason="needs `make scale`")
from ray.exceptions import ActorDiedError

from carpool.engine.outputs import RequestOutput
from carpool.engine.request import EngineRequest
from carpool.engine.sampling_params import SamplingParams
from carpool.server.replicas.router import ReplicaFailed, ReplicaRouter
from carpool.server.replicas.routing import PrefixAffinity, ReplicaLoad, RoundRobin, make_routing

BLOCK = 16
DOC_A, DOC_B = list(range(1, 161)), list(range(500, 660))  # ten blocks each


def request(prompt, salt=None, tier="default", rid="r"):
    return EngineRequest(rid, prompt, SamplingParams(max_tokens=4), tier, salt)


def loads(n=2, slots=8):
    return [ReplicaLoad(slots=slots) for _ in range(n)]


def test_prefix_affinity_keeps_a_document_on_one_replica_and_round_robin_does_not():
    prefix, turns, state = PrefixAffinity(BLOCK), RoundRobin(), loads()
    chosen = []
    for question in range(6):
        doc = DOC_A if question % 2 == 0 else DOC_B
        index = prefix.choose(request(doc + [900 + question]), state)
        state[index].in_flight += 1  # the requests stay in flight: affinity must still beat a load of 3 vs 2
        chosen.append((doc is DOC_A, index))
    by_doc = {doc: {index for is_a, index in chosen if is_a == doc} for doc in (True, False)}
    assert all(len(replicas) == 1 for replicas in by_doc.values()) and by_doc[True] != by_doc[False]
    robin = [turns.choose(request(DOC_A + [900 + q]), loads()) for q in range(4)]
    assert robin == [0, 1, 0, 1]


def test_the_cache_salt_makes_equal_prompts_different_prefixes():
    prefix, state = PrefixAffinity(BLOCK), loads()
    first = prefix.choose(request(DOC_A, salt="key:a"), state)
    state[first].in_flight += 1
    assert prefix.choose(request(DOC_A, salt="key:b"), state) != first  # no match: the least loaded
    assert prefix.choose(request(DOC_A, salt="key:a"), state) == first


def test_an_overloaded_replica_spills_to_the_least_loaded_and_priority_needs_room():
    prefix, state = PrefixAffinity(BLOCK, imbalance=2), loads(slots=4)
    home = prefix.choose(request(DOC_A), state)
    state[home].in_flight, state[1 - home].in_flight = 4, 3
    assert prefix.choose(request(DOC_A), state) == home  # full, but within the imbalance: it waits for its cache
    assert prefix.choose(request(DOC_A, tier="priority"), state) != home  # priority needs a free slot
    spilled = PrefixAffinity(BLOCK, imbalance=2)
    home = spilled.choose(request(DOC_B), state := loads(slots=8))
    state[home].in_flight = 3
    assert spilled.choose(request(DOC_B), state) != home  # 3 more in flight than the other replica
    state[home].in_flight, state[1 - home].healthy = 0, False
    assert spilled.choose(request(DOC_A), state) == home  # a down replica gets nothing


def test_unknown_routing_is_a_value_error_naming_it():
    with pytest.raises(ValueError, match="routing"):
        make_routing("random", BLOCK)


class FakeReplica:
    """A Ray Serve handle's shape: `.options(stream=True).generate.remote(request)` -> async iterator."""

    def __init__(self, dies_after: int | None):
        self.dies_after, self.calls = dies_after, 0

    def options(self, stream):
        return self

    @property
    def generate(self):
        return self

    def remote(self, wire):
        self.calls += 1
        return FakeStream(wire, self.dies_after)


class FakeStream:
    def __init__(self, wire, dies_after):
        self.wire, self.dies_after = wire, dies_after

    async def __aiter__(self):
        for step in range(3):
            if self.dies_after is not None and step == self.dies_after:
                raise ActorDiedError()
            yield RequestOutput(self.wire.request_id, self.wire.prompt_token_ids, list(range(step + 1)), "", step == 2)

    def cancel(self):
        pass


class Door:
    tokenizer, max_model_len = None, 2048


def router(replicas):
    from carpool.engine.config import EngineConfig

    return ReplicaRouter("m", replicas, Door(), EngineConfig(), RoundRobin(), 8)


async def drain(router_, req):
    return [output async for output in router_.generate(req)]


def test_a_batch_line_on_a_dying_replica_runs_again_on_another():
    dying, healthy = FakeReplica(dies_after=1), FakeReplica(dies_after=None)
    router_ = router([dying, healthy])
    outputs = asyncio.run(drain(router_, request(DOC_A, tier="batch")))
    assert outputs[-1].finished and dying.calls == 1 and healthy.calls == 1
    assert not router_.loads[0].healthy and router_.loads[0].in_flight == 0


def test_a_streaming_request_on_a_dying_replica_fails_retryably():
    router_ = router([FakeReplica(dies_after=1), FakeReplica(dies_after=None)])
    with pytest.raises(ReplicaFailed, match="retry"):
        asyncio.run(drain(router_, request(DOC_A)))
    # One that had shown nothing yet goes to the other replica instead.
    dead_at_once = router([FakeReplica(dies_after=0), FakeReplica(dies_after=None)])
    assert asyncio.run(drain(dead_at_once, request(DOC_A)))[-1].finished
