"""Anthropic's Messages API with the official `anthropic` SDK against a live server on SmolLM2 (text) and
Qwen2.5-Coder 0.5B (tools): create, stream, each tool_choice, count_tokens, Message Batches end to end, and bad
input answered 4xx in Anthropic's error shape naming the field, with the server healthy and no block leaked."""

import time

import anthropic
import httpx
import pytest

SMOL, QWEN = "smollm2-135m", "qwen2.5-coder-0.5b"
KEY, OTHER_KEY = "sk-anthropic-test", "sk-anthropic-other"
HI = [{"role": "user", "content": "Say hi to Ann."}]
# Greedy on a prompt whose answer cannot end within 6 tokens, for the tests about a stop reason's name or the event
# sequence: "Say hi to Ann." ended at its 5th token in two clean clones' CI runs (greedy near a tie once, sampled at
# Anthropic's default temperature 1 once).
COUNT = [{"role": "user", "content": "Count from one to twenty in words, one number a line."}]
GREEDY = {"extra_body": {"temperature": 0}}
WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city",
    "input_schema": {
        "type": "object",
        "additionalProperties": False,
        "required": ["city"],
        "properties": {"city": {"type": "string", "maxLength": 20}},
    },
}
TIME = {
    "name": "get_time",
    "input_schema": {
        "type": "object",
        "additionalProperties": False,
        "required": ["zone"],
        "properties": {"zone": {"type": "string", "maxLength": 12}},
    },
}
WEATHER_ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(two_models_two_keys):
    return two_models_two_keys


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0)


def test_create_answers_a_message_with_usage_and_request_id(client):
    raw = client.messages.with_raw_response.create(model=SMOL, max_tokens=6, messages=COUNT, **GREEDY)
    message = raw.parse()
    assert raw.headers["request-id"] == raw.headers["x-request-id"]
    assert message.id.startswith("msg_") and message.type == "message" and message.role == "assistant"
    assert message.model == SMOL and [block.type for block in message.content] == ["text"]
    assert message.stop_reason == "max_tokens" and message.usage.output_tokens == 6
    usage = message.usage
    assert usage.input_tokens + usage.cache_read_input_tokens + usage.cache_creation_input_tokens > 5
    assert usage.cache_creation.ephemeral_5m_input_tokens == usage.cache_creation.ephemeral_1h_input_tokens == 0
    assert usage.service_tier == "standard"


def test_system_blocks_metadata_and_sampling_fields_are_taken(client):
    message = client.messages.create(
        model=SMOL,
        max_tokens=4,
        system=[{"type": "text", "text": "You are terse."}, {"type": "text", "text": "Answer in English."}],
        messages=HI,
        # Sampling fields the SDK no longer names (Anthropic's newer models drop them); the API still takes them.
        extra_body={"temperature": 0.5, "top_p": 0.9, "top_k": 20},
        metadata={"user_id": "ann"},
        service_tier="standard_only",
    )
    assert message.usage.output_tokens <= 4


def test_stop_sequence_is_reported_with_the_string_that_ended_it(client):
    ask = {"model": SMOL, "max_tokens": 16, "messages": HI, "extra_body": {"temperature": 0}}
    # Asked twice, the second answer read: it starts from the prefix cache as the stopped request does, and a
    # cache hit may flip a near-tie in the greedy tokens (issue 53), so both must start alike.
    client.messages.create(**ask)
    text = client.messages.create(**ask).content[0].text
    words = text.split()
    assert len(words) >= 3, text
    stop = " " + words[2]
    message = client.messages.create(**ask, stop_sequences=[stop, "never-written"])
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == stop
    assert stop not in message.content[0].text


def test_stream_sends_anthropics_event_sequence(client, server):
    with client.messages.stream(model=SMOL, max_tokens=6, messages=COUNT, **GREEDY) as stream:
        kinds = [event.type for event in stream if event.type not in ("text",)]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    assert kinds[1] == "content_block_start" and kinds[-3] == "content_block_stop"
    assert set(kinds[2:-3]) == {"content_block_delta"}
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 6 and final.content[0].text
    body = {"model": SMOL, "max_tokens": 3, "messages": HI, "stream": True}
    raw = httpx.post(f"{server.url}/v1/messages", json=body, headers={"x-api-key": KEY}, timeout=60).text
    events = [line.removeprefix("event: ") for line in raw.splitlines() if line.startswith("event: ")]
    assert events[:2] == ["message_start", "ping"]


def test_tool_choice_any_and_named_tool_give_tool_use_blocks(client):
    message = client.messages.create(
        model=QWEN,
        max_tokens=40,
        tools=[WEATHER, TIME],
        # One call ends the turn; with parallel calls allowed the model may write calls until max_tokens.
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
        messages=WEATHER_ASK,
    )
    assert message.stop_reason == "tool_use"
    calls = [block for block in message.content if block.type == "tool_use"]
    assert calls and all(call.id.startswith("toolu_") and call.name in ("get_weather", "get_time") for call in calls)
    named = client.messages.create(
        model=QWEN,
        max_tokens=40,
        tools=[WEATHER, TIME],
        tool_choice={"type": "tool", "name": "get_time", "disable_parallel_tool_use": True},
        messages=WEATHER_ASK,
    )
    [call] = [block for block in named.content if block.type == "tool_use"]
    assert call.name == "get_time" and set(call.input) == {"zone"}


def test_tool_choice_auto_and_none(client):
    auto = client.messages.create(
        model=QWEN, max_tokens=40, tools=[WEATHER], tool_choice={"type": "auto"}, messages=WEATHER_ASK
    )
    for block in auto.content:
        assert block.type == "text" or (block.name == "get_weather" and isinstance(block.input["city"], str))
    assert (auto.stop_reason == "tool_use") == any(block.type == "tool_use" for block in auto.content)
    none = client.messages.create(
        model=QWEN, max_tokens=10, tools=[WEATHER], tool_choice={"type": "none"}, messages=WEATHER_ASK
    )
    assert [block.type for block in none.content] == ["text"]


def test_streamed_tool_use_sends_input_json_deltas(client):
    with client.messages.stream(
        model=QWEN,
        max_tokens=40,
        tools=[WEATHER],
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
        messages=WEATHER_ASK,
    ) as stream:
        deltas = [event.delta.type for event in stream if event.type == "content_block_delta"]
        final = stream.get_final_message()
    assert "input_json_delta" in deltas and final.stop_reason == "tool_use"
    [call] = [block for block in final.content if block.type == "tool_use"]
    assert call.name == "get_weather" and isinstance(call.input["city"], str)


def test_tool_results_go_back_to_the_model(client):
    messages = [
        *WEATHER_ASK,
        {
            "role": "assistant",
            "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "Sunny, 21C"}]},
                {"type": "text", "text": "Tell me briefly."},
            ],
        },
    ]
    message = client.messages.create(model=QWEN, max_tokens=8, tools=[WEATHER], messages=messages)
    assert message.content and message.usage.output_tokens <= 8


def test_count_tokens_is_the_prompt_a_create_runs(client):
    counted = client.messages.count_tokens(model=QWEN, tools=[WEATHER], system="Be brief.", messages=WEATHER_ASK)
    usage = client.messages.create(
        model=QWEN, max_tokens=1, tools=[WEATHER], system="Be brief.", messages=WEATHER_ASK
    ).usage
    assert (
        counted.input_tokens == usage.input_tokens + usage.cache_read_input_tokens + usage.cache_creation_input_tokens
    )


def test_keys_by_x_api_key_or_bearer_and_a_bad_key_is_authentication_error(server):
    bearer = anthropic.Anthropic(base_url=server.url, auth_token=KEY, max_retries=0)
    assert bearer.messages.count_tokens(model=SMOL, messages=HI).input_tokens > 0
    with pytest.raises(anthropic.AuthenticationError) as raised:
        anthropic.Anthropic(base_url=server.url, api_key="sk-wrong", max_retries=0).messages.count_tokens(
            model=SMOL, messages=HI
        )
    assert raised.value.body["error"]["type"] == "authentication_error"


def test_unknown_model_is_not_found_error(client):
    with pytest.raises(anthropic.NotFoundError) as raised:
        client.messages.create(model="no-such-model", max_tokens=2, messages=HI)
    assert raised.value.body["type"] == "error" and raised.value.body["error"]["type"] == "not_found_error"


BREAKPOINT = {"type": "ephemeral"}
HOUR = {"type": "ephemeral", "ttl": "1h"}
BAD_BODIES = [
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "messages[0].content[0]: image"),
    ({"messages": [{"role": "user", "content": [{"type": "document"}]}]}, "messages[0].content[0]: document"),
    ({"messages": [{"role": "user", "content": [{"type": "thinking"}]}]}, "messages[0].content[0]: thinking"),
    ({"messages": [{"role": "user", "content": [{"type": "fancy"}]}]}, "messages[0].content[0]: Input tag 'fancy'"),
    ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages[0].content[0].text"),
    ({"messages": [{"role": "user", "content": [{"text": "x"}]}]}, "messages[0].content[0]"),
    ({"messages": [{"role": "assistant", "content": "hi"}]}, "messages[0].role"),
    ({"messages": [HI[0], HI[0]]}, "messages[1].role"),
    ({"messages": []}, "messages:"),
    ({"messages": [{"role": "user", "content": ""}]}, "messages[0].content"),
    ({"messages": HI, "max_tokens": None}, "max_tokens"),
    ({"messages": HI, "max_tokens": 0}, "max_tokens"),
    ({"messages": HI, "temperature": 1.5}, "temperature"),
    ({"messages": HI, "stop_sequences": ["a", "b", "c", "d", "e"]}, "stop_sequences"),
    ({"messages": HI, "thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking"),
    ({"messages": HI, "service_tier": "batch"}, "service_tier"),
    ({"messages": HI, "tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools[0].type"),
    ({"messages": HI, "tool_choice": {"type": "tool"}}, "tool_choice"),
    ({"messages": HI, "tool_choice": {"type": "any"}}, "tool_choice"),
    ({"messages": HI, "frequency_penalty": 1}, "frequency_penalty: unknown field"),
    (
        {
            "messages": [
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_9", "content": "r"}]}
            ]
        },
        "messages[0].content[0].tool_use_id",
    ),
    (
        {
            "messages": [
                HI[0],
                {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "f", "input": {}}]},
                HI[0],
            ]
        },
        "messages[2]: tool_use ids ['t1']",
    ),
    (
        {
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "text", "text": f"p{i}", "cache_control": BREAKPOINT} for i in range(5)],
                }
            ]
        },
        "messages[0].content[4].cache_control: at most 4",
    ),
    (
        {
            "system": [{"type": "text", "text": "s", "cache_control": BREAKPOINT}],
            "messages": [{"role": "user", "content": [{"type": "text", "text": "u", "cache_control": HOUR}]}],
        },
        "messages[0].content[0].cache_control: a ttl of '1h' may not come after",
    ),
    (
        {
            "cache_control": BREAKPOINT,
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "text", "text": f"p{i}", "cache_control": HOUR} for i in range(3)]
                    + [{"type": "text", "text": "q"}],
                }
            ],
            "system": [{"type": "text", "text": "s", "cache_control": HOUR}],
        },
        "messages[0].content[3].cache_control: at most 4",
    ),
    (
        {"messages": HI, "tools": [{"name": "f", "input_schema": {"type": "object"}}] * 2},
        "tools: tool names must be unique: 'f' is the name of tools[0] and tools[1]",
    ),
    ({"messages": HI, "cache_control": {"type": "persistent"}}, "cache_control.type"),
    ({"messages": HI, "cache_control": {"type": "ephemeral", "ttl": "2h"}}, "cache_control.ttl"),
]


@pytest.mark.parametrize(("body", "named"), BAD_BODIES)
def test_bad_input_is_a_400_in_anthropics_shape_naming_the_field(client, body, named):
    with pytest.raises(anthropic.BadRequestError) as raised:
        # As extra_body, which the SDK sends as it is: fields it would refuse to send, or types it would fix.
        client.messages.create(model=SMOL, max_tokens=4, messages=HI, extra_body=body)
    error = raised.value.body
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert named in error["error"]["message"], error


def test_bodies_that_are_not_json_or_too_large_and_the_server_stays_healthy(server):
    http = httpx.Client(base_url=server.url, headers={"x-api-key": KEY}, timeout=60)
    for content in (b"\xff\xfe not utf-8", b"{", b"[1, 2]", b"null"):
        answer = http.post("/v1/messages", content=content, headers={"content-type": "application/json"})
        assert answer.status_code == 400 and answer.json()["type"] == "error", answer.text
    huge = http.post("/v1/messages", content=b"x" * (5 * 2**20))
    assert huge.status_code == 413 and huge.json()["error"]["type"] == "request_too_large"
    assert http.get("/health").status_code == 200
    server.wait_idle()


def test_message_batch_end_to_end_at_the_batch_tier(server, client):
    requests = [
        {"custom_id": "first", "params": {"model": SMOL, "max_tokens": 3, "messages": HI}},
        {"custom_id": "second", "params": {"model": SMOL, "max_tokens": 2, "messages": WEATHER_ASK}},
        {"custom_id": "no-model", "params": {"model": "no-such-model", "max_tokens": 2, "messages": HI}},
    ]
    batch = client.messages.batches.create(requests=requests)
    assert batch.id.startswith("msgbatch_") and batch.processing_status == "in_progress"
    assert batch.request_counts.processing == 3
    batch = _wait_for_end(client, batch.id)
    counts = batch.request_counts
    assert (counts.succeeded, counts.errored, counts.canceled, counts.expired, counts.processing) == (2, 1, 0, 0, 0)
    assert batch.ended_at is not None and batch.results_url
    results = {line.custom_id: line.result for line in client.messages.batches.results(batch.id)}
    assert set(results) == {"first", "second", "no-model"}
    assert results["first"].type == "succeeded" and results["first"].message.usage.service_tier == "batch"
    assert results["first"].message.usage.output_tokens == 3
    assert results["no-model"].type == "errored" and results["no-model"].error.error.type == "not_found_error"
    assert batch.id in [listed.id for listed in client.messages.batches.list(limit=5)]
    # Another key sees nothing of it; the owner deletes it, and then it is gone.
    stranger = anthropic.Anthropic(base_url=server.url, api_key=OTHER_KEY, max_retries=0)
    with pytest.raises(anthropic.NotFoundError):
        stranger.messages.batches.retrieve(batch.id)
    assert batch.id not in [listed.id for listed in stranger.messages.batches.list()]
    with pytest.raises(anthropic.NotFoundError):
        stranger.messages.batches.delete(batch.id)
    assert client.messages.batches.delete(batch.id).type == "message_batch_deleted"
    with pytest.raises(anthropic.NotFoundError):
        client.messages.batches.retrieve(batch.id)


def test_a_cancelled_batch_answers_every_custom_id_once(client):
    requests = [{"custom_id": f"r{i}", "params": {"model": SMOL, "max_tokens": 8, "messages": HI}} for i in range(24)]
    batch = client.messages.batches.create(requests=requests)
    cancelling = client.messages.batches.cancel(batch.id)
    assert cancelling.processing_status in ("canceling", "ended") and cancelling.cancel_initiated_at is not None
    batch = _wait_for_end(client, batch.id)
    counts = batch.request_counts
    assert counts.succeeded + counts.canceled + counts.errored == 24 and counts.errored == 0
    kinds = [(line.custom_id, line.result.type) for line in client.messages.batches.results(batch.id)]
    assert sorted(custom_id for custom_id, _ in kinds) == sorted(f"r{i}" for i in range(24))
    assert sum(kind == "canceled" for _, kind in kinds) == counts.canceled


def test_batch_params_are_checked_at_creation_naming_the_request(client):
    bad = [
        {"custom_id": "ok", "params": {"model": SMOL, "max_tokens": 3, "messages": HI}},
        {
            "custom_id": "bad",
            "params": {"model": SMOL, "max_tokens": 3, "messages": [{"role": "assistant", "content": "x"}]},
        },
    ]
    with pytest.raises(anthropic.BadRequestError) as raised:
        client.messages.batches.create(requests=bad)
    assert "requests[1].params.messages[0].role" in raised.value.body["error"]["message"]
    for requests, named in (
        ([], "requests"),
        ([bad[0], bad[0]], "requests[1].custom_id"),
        ([{"custom_id": "x y", "params": bad[0]["params"]}], "requests[0].custom_id"),
        ([{"custom_id": "s", "params": bad[0]["params"] | {"stream": True}}], "requests[0].params.stream"),
        ([{"custom_id": "m", "params": {"model": SMOL, "messages": HI}}], "requests[0].params.max_tokens"),
    ):
        with pytest.raises(anthropic.BadRequestError) as raised:
            client.messages.batches.create(requests=requests)
        assert named in raised.value.body["error"]["message"]
    with pytest.raises(anthropic.NotFoundError):
        client.messages.batches.retrieve("msgbatch_000000000000000000000000")


def _wait_for_end(client, batch_id: str, timeout: float = 240):
    deadline = time.monotonic() + timeout
    while True:
        batch = client.messages.batches.retrieve(batch_id)
        if batch.processing_status == "ended":
            return batch
        assert time.monotonic() < deadline, batch
        time.sleep(0.2)


def test_cache_control_breakpoints_are_taken_and_count_tokens_agrees(client):
    ask = {
        "model": SMOL,
        "system": [{"type": "text", "text": "You are terse.", "cache_control": {"type": "ephemeral", "ttl": "1h"}}],
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "Say hi.", "cache_control": {"type": "ephemeral"}}]}
        ],
        "cache_control": {"type": "ephemeral"},
    }
    usage = client.messages.create(max_tokens=2, **ask).usage
    counted = client.messages.count_tokens(**ask).input_tokens
    assert counted == usage.input_tokens + usage.cache_read_input_tokens + usage.cache_creation_input_tokens
    creation = usage.cache_creation
    assert usage.cache_creation_input_tokens == creation.ephemeral_5m_input_tokens + creation.ephemeral_1h_input_tokens
