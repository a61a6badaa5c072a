"""The engine's door (carpool.engine.door): a request is tokenized, checked and settled once, in `request()`, and
crosses to the engine thread as that EngineRequest; nothing past the door checks or derives it again."""

import asyncio
from collections import Counter

import pytest

import carpool.engine
from carpool.engine import AsyncEngine, ContextLengthExceeded, EngineRequest, SamplingParams
from carpool.engine.tiers import BY_NAME

PARAMS = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)


@pytest.fixture
def calls(llm, monkeypatch):
    """How often the engine tokenizes text and checks a request's lengths, vocabulary and params; and the
    Sequences it enqueued (in `calls.seqs`)."""
    counted = Counter()
    counted.seqs = []
    engine = llm.engine
    for owner, name in (
        (engine.tokenizer, "encode"),
        (engine.door, "_check_length"),
        (engine.door, "_check_vocabulary"),
        (engine.door, "_check_params"),
        (engine, "enqueue"),
    ):
        original = getattr(owner, name)

        def counting(*args, _original=original, _name=name, **kwargs):
            counted[_name] += 1
            result = _original(*args, **kwargs)
            if _name == "enqueue":
                counted.seqs.append(result)
            return result

        monkeypatch.setattr(owner, name, counting)
    return counted


def run_on_a_loop_thread(llm, request: EngineRequest) -> list:
    async_engine = AsyncEngine(engine=llm.engine)
    async_engine.start()
    try:

        async def collect():
            return [output async for output in async_engine.generate(request)]

        return asyncio.run(collect())
    finally:
        async_engine.stop()


def test_a_served_request_is_tokenized_and_checked_once(llm, calls):
    async_engine = AsyncEngine(engine=llm.engine)
    request = async_engine.door.request("door-once", "Name a colour.", PARAMS, tier="flex", cache_salt="tenant")
    assert dict(calls) == {"encode": 1, "_check_length": 1, "_check_vocabulary": 3, "_check_params": 1}
    outputs = run_on_a_loop_thread(llm, request)
    assert outputs[-1].finished and len(outputs[-1].token_ids) == 3
    # Past the door: enqueued as it is, no second tokenization or check (the vocabulary: prompt, logit_bias,
    # stop_token_ids, once each).
    assert dict(calls) == {"encode": 1, "_check_length": 1, "_check_vocabulary": 3, "_check_params": 1, "enqueue": 1}
    (seq,) = calls.seqs
    assert seq.prompt_token_ids == request.prompt_token_ids and seq.params is request.params
    assert seq.priority == BY_NAME["flex"].priority and seq.cache_salt == "tenant"
    assert seq.times.arrival == request.arrival_time  # queue time counts from the door
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks


def test_the_door_names_what_is_wrong(llm):
    engine = llm.engine
    vocab = engine.model_config.vocab_size
    with pytest.raises(ValueError, match="^tier"):
        engine.request("r", "hi", PARAMS, tier="gold")
    with pytest.raises(ValueError, match="^prompt: token ids"):
        engine.request("r", [1, vocab], PARAMS)
    with pytest.raises(ValueError, match="^logit_bias"):
        engine.request("r", "hi", SamplingParams(logit_bias={vocab: 1.0}))
    with pytest.raises(ValueError, match="^params"):
        engine.request("r", "hi", {"max_tokens": 3})
    with pytest.raises(ContextLengthExceeded, match="^max_tokens"):
        engine.request("r", "hi", SamplingParams(max_tokens=engine.door.max_request_tokens))
    for salt in (123, "\ud800"):  # hashed on the engine thread, where it would end the loop
        with pytest.raises(ValueError, match="^cache_salt"):
            engine.request("r", "hi", PARAMS, cache_salt=salt)
    assert not engine.has_unfinished_requests()


def test_an_id_in_use_is_refused_on_the_engine_thread(llm):
    engine = llm.engine
    engine.enqueue(engine.request("twice", "hi", PARAMS))
    try:
        with pytest.raises(ValueError, match="request_id 'twice' is already in use"):
            engine.enqueue(engine.request("twice", "hi", PARAMS))
    finally:
        engine.abort("twice")
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_the_package_exports_what_it_offers():
    for name in carpool.engine.__all__:
        assert getattr(carpool.engine, name) is not None, name
    assert {
        "LLMEngine",
        "AsyncEngine",
        "EngineRequest",
        "EngineConfig",
        "SamplingParams",
        "RequestOutput",
        "TIERS",
    } <= set(carpool.engine.__all__)


def test_the_door_settles_a_missing_max_tokens_to_the_rest_of_the_window(llm):
    door = llm.engine.door
    request = door.request("rest", "Name a colour.", SamplingParams(max_tokens=None, min_tokens=2))
    assert request.params.max_tokens == door.max_request_tokens - len(request.prompt_token_ids)
    with pytest.raises(ContextLengthExceeded, match="^prompt: "):
        door.request("full", [1] * door.max_request_tokens, SamplingParams(max_tokens=None))
