"""Service tiers on a server with two sequence slots and four queue places per tier: priority jumps the queue,
preempts flex when every slot is taken, and a full queue answers 429."""

import asyncio
import time

import openai
import pytest

MESSAGES = [{"role": "user", "content": "Write a long story about a lighthouse."}]
ENDLESS = {"ignore_eos": True}  # outputs of a known length, whatever the model would say
NO_LABELS = frozenset()


def waiting(server) -> float:
    return server.metrics()[("carpool:num_requests_waiting", NO_LABELS)]


def wait_for(condition, timeout=30.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def open_stream(client, model, tier, max_tokens=2000):
    """A streaming request, returned once its first chunk is in (so it holds a sequence slot)."""
    stream = client.chat.completions.create(
        model=model,
        messages=MESSAGES,
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        service_tier=tier,
        extra_body=ENDLESS,
    )
    next(iter(stream))
    return stream


@pytest.fixture
def small(small_server):
    small_server.wait_idle()
    yield small_server
    small_server.wait_idle()


@pytest.fixture(scope="module")
def model(small_server):
    return small_server.client().models.list().data[0].id


def test_priority_finishes_ahead_of_queued_flex(small, model):
    finished = []

    async def scenario():
        async with openai.AsyncOpenAI(base_url=f"{small.url}/v1", api_key="unused", max_retries=0) as client:

            async def ask(tag, tier):
                await client.chat.completions.create(
                    model=model, messages=MESSAGES, max_tokens=24, temperature=0, service_tier=tier, extra_body=ENDLESS
                )
                finished.append(tag)

            flex = [asyncio.create_task(ask(f"flex-{i}", "flex")) for i in range(4)]
            while await asyncio.to_thread(waiting, small) < 2:  # two run, two queue
                await asyncio.sleep(0.05)
            await ask("priority", "priority")
            await asyncio.gather(*flex)

    asyncio.run(scenario())
    # First come first served would finish it last; at most the flex request it ran beside can finish first.
    assert finished.index("priority") <= 1, finished


def test_priority_preempts_when_max_num_seqs_is_full(small, model):
    client = small.client()
    before = small.metrics()[("carpool:num_preemptions_total", NO_LABELS)]
    flex = [open_stream(client, model, "flex") for _ in range(2)]  # both slots taken; memory is plentiful
    # Without preemption on max_num_seqs this would wait for 2000 flex tokens: the timeout fails it fast.
    response = client.with_options(timeout=60).chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=4, temperature=0, service_tier="priority", extra_body=ENDLESS
    )
    assert response.choices[0].finish_reason == "length" and response.service_tier == "priority"
    assert small.metrics()[("carpool:num_preemptions_total", NO_LABELS)] > before
    for stream in flex:  # the preempted request resumes and keeps streaming
        chunks = [chunk for chunk, _ in zip(stream, range(3))]
        assert len(chunks) == 3 and all(chunk.choices[0].finish_reason is None for chunk in chunks)
        stream.close()


def test_full_queue_answers_429(small, model):
    client = small.client()
    running = [open_stream(client, model, "default") for _ in range(2)]
    queued = [
        client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=8, stream=True, service_tier="flex")
        for _ in range(4)
    ]
    wait_for(lambda: waiting(small) == 4)
    with pytest.raises(openai.RateLimitError) as raised:
        client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=8, service_tier="flex")
    assert raised.value.body["code"] == "rate_limit_exceeded"
    assert raised.value.response.headers["Retry-After"] == "1"
    # The limit is per tier: a priority request still gets in (and, preempting, through).
    response = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=2, service_tier="priority")
    assert response.choices[0].finish_reason in ("length", "stop")
    for stream in running + queued:
        stream.close()
    small.wait_idle()
    # Hung-up requests gave their queue places back.
    assert client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=1, service_tier="flex")
