"""The Responses API (`/v1/responses`) with the official `openai` SDK against a live server on SmolLM2 and
Qwen2.5: whole and streamed responses (the SDK's own event types and accumulator), a function tool's round trip,
`text.format` parsed by `client.responses.parse`, stored responses continued, read and deleted, and private to
their key, and what this server does not serve refused as 400s naming it."""

import json

import httpx
import openai
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import BaseModel, Field, TypeAdapter

SMOL, QWEN = "smollm2-135m", "qwen2.5-coder-0.5b"
KEY, OTHER_KEY = "sk-responses-a", "sk-responses-b"
STREAM_EVENTS = TypeAdapter(ResponseStreamEvent)


class Person(BaseModel):
    name: str = Field(max_length=12)
    age: int


WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {
        "type": "object",
        "additionalProperties": False,
        "required": ["city", "unit"],
        "properties": {
            "city": {"type": "string", "maxLength": 20},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        },
    },
}
WEATHER_ASK = "What is the weather in Paris?"


@pytest.fixture(scope="module")
def server(two_models_two_keys):
    return two_models_two_keys


@pytest.fixture(scope="module")
def client(server):
    return server.client()


def test_a_plain_response_has_the_sdks_shape_and_usage(server, client):
    response = client.responses.create(
        model=SMOL, input="Say hello.", instructions="Be brief.", max_output_tokens=8, temperature=0
    )
    assert response.id.startswith("resp_") and response.object == "response" and response.model == SMOL
    assert response.status in ("completed", "incomplete") and response.output_text
    [message] = response.output
    assert message.type == "message" and message.role == "assistant" and message.content[0].type == "output_text"
    usage = response.usage
    assert usage.output_tokens <= 8 and usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert usage.input_tokens_details.cached_tokens >= 0 and usage.output_tokens_details.reasoning_tokens == 0
    assert response.instructions == "Be brief." and response.service_tier == "default"
    # The wire body validates against the SDK's own model, not only the SDK's lenient construction.
    raw = server.http().post(
        "/v1/responses", json={"model": SMOL, "input": "Say hello.", "max_output_tokens": 8, "temperature": 0}
    )
    Response.model_validate(raw.json())
    cut = client.responses.create(model=SMOL, input="Count to fifty.", max_output_tokens=3, temperature=0)
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"


def test_a_stream_sends_the_responses_event_sequence(client):
    # 30 tokens: SmolLM2's greedy answer ends in 23, so the response completes (the SDK's helper needs that).
    events = list(
        client.responses.create(model=SMOL, input="Say hello.", max_output_tokens=30, temperature=0, stream=True)
    )
    kinds = [event.type for event in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [event.sequence_number for event in events] == list(range(len(events)))
    text = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    assert text and events[-1].response.output_text == text
    assert events[-1].response.usage.output_tokens > 0
    # The SDK's accumulating helper reads the same events into the same response.
    with client.responses.stream(model=SMOL, input="Say hello.", max_output_tokens=30, temperature=0) as stream:
        assert stream.get_final_response().output_text == text


def test_a_function_tool_round_trip(client):
    ask = [{"role": "user", "content": WEATHER_ASK}]
    first = client.responses.create(model=QWEN, input=ask, tools=[WEATHER], tool_choice="required", temperature=0)
    [call] = [item for item in first.output if item.type == "function_call"]
    assert call.name == "get_weather" and json.loads(call.arguments)["city"] and call.call_id.startswith("call_")
    result = {"type": "function_call_output", "call_id": call.call_id, "output": '{"temperature": 21}'}
    answer = client.responses.create(
        model=QWEN,
        input=ask + [item.model_dump(exclude_none=True) for item in first.output] + [result],
        tools=[WEATHER],
        max_output_tokens=12,
        temperature=0,
    )
    assert answer.output_text and not [item for item in answer.output if item.type == "function_call"]


def test_a_streamed_function_call(client):
    events = list(
        client.responses.create(
            model=QWEN, input=WEATHER_ASK, tools=[WEATHER], tool_choice="required", temperature=0, stream=True
        )
    )
    kinds = [event.type for event in events]
    assert "response.function_call_arguments.delta" in kinds and kinds[-1] == "response.completed"
    [done] = [event for event in events if event.type == "response.function_call_arguments.done"]
    [call] = events[-1].response.output
    assert call.type == "function_call" and call.arguments == done.arguments and json.loads(done.arguments)["city"]


@pytest.mark.parametrize(
    "body",
    [
        {"model": SMOL, "input": "Say hello.", "max_output_tokens": 6},
        {"model": QWEN, "input": WEATHER_ASK, "tools": [WEATHER], "tool_choice": "required", "max_output_tokens": 60},
    ],
)
def test_every_streamed_event_validates_against_the_sdks_types(server, body):
    """The SDK builds events without validating them; here each wire event must validate strictly."""
    # A long timeout: Qwen's first constrained request builds its token table (seconds on a loaded machine).
    with (
        server.http() as http,
        http.stream("POST", "/v1/responses", json=body | {"stream": True}, timeout=300) as answer,
    ):
        lines = [line for line in answer.iter_lines() if line]
    kinds = [line.removeprefix("event: ") for line in lines[::2]]
    events = [STREAM_EVENTS.validate_json(line.removeprefix("data: ")) for line in lines[1::2]]
    assert [event.type for event in events] == kinds and kinds[-1] in ("response.completed", "response.incomplete")


def test_text_format_json_schema_parses(client):
    parsed = client.responses.parse(
        model=SMOL, input="Describe a person called Ann who is 30.", text_format=Person, max_output_tokens=40
    )
    assert isinstance(parsed.output_parsed, Person)
    obj = client.responses.create(
        model=QWEN,
        input="Return a JSON object with one key, age, for a 30 year old.",
        text={"format": {"type": "json_object"}},
        max_output_tokens=60,
        temperature=0,
    )
    assert isinstance(json.loads(obj.output_text), dict)


def test_input_items_list_what_a_stored_response_answered_a_page_at_a_time(server, client):
    first = client.responses.create(model=SMOL, input="My name is Ann.", max_output_tokens=4, temperature=0)
    second = client.responses.create(
        model=SMOL, input="What is my name?", previous_response_id=first.id, max_output_tokens=4, temperature=0
    )
    newest_first = client.responses.input_items.list(second.id).data  # the default order: desc
    assert [(item.type, item.role) for item in newest_first] == [("message", "user"), ("message", "assistant")] + [
        ("message", "user")
    ]
    assert newest_first[0].content[0].text == "What is my name?" and newest_first[0].content[0].type == "input_text"
    assert newest_first[1].content[0].text == first.output_text and newest_first[1].content[0].type == "output_text"
    assert newest_first[2].content[0].text == "My name is Ann."
    # The first response's output item keeps its own id and status (cut by max_output_tokens: incomplete).
    assert (newest_first[1].id, newest_first[1].status) == (first.output[0].id, first.output[0].status)
    assert (
        len({item.id for item in newest_first}) == 3 and newest_first[0].status == newest_first[2].status == "completed"
    )
    page = client.responses.input_items.list(second.id, order="asc", limit=1)
    assert page.has_more and [item.id for item in page.data] == [newest_first[2].id]
    rest = client.responses.input_items.list(second.id, order="asc", limit=2, after=page.data[0].id)
    assert [item.id for item in rest.data] == [newest_first[1].id, newest_first[0].id] and not rest.has_more
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.input_items.list(second.id, include=["message.output_text.logprobs"])
    assert refused.value.body["param"] == "include"
    other = openai.OpenAI(base_url=f"{server.url}/v1", api_key=OTHER_KEY, max_retries=0)
    with pytest.raises(openai.NotFoundError):
        other.responses.input_items.list(second.id)


def test_stored_responses_continue_and_are_private_to_their_key(server, client):
    first = client.responses.create(model=SMOL, input="My name is Ann.", max_output_tokens=4, temperature=0)
    second = client.responses.create(
        model=SMOL, input="What is my name?", previous_response_id=first.id, max_output_tokens=4, temperature=0
    )
    assert second.previous_response_id == first.id
    # The continuation's prompt holds the first turn: more input tokens than the question alone.
    alone = client.responses.create(model=SMOL, input="What is my name?", max_output_tokens=4, temperature=0)
    assert second.usage.input_tokens > alone.usage.input_tokens + first.usage.output_tokens
    assert client.responses.retrieve(second.id).output_text == second.output_text
    other = openai.OpenAI(base_url=f"{server.url}/v1", api_key=OTHER_KEY, max_retries=0)
    for attempt in (
        lambda: other.responses.retrieve(first.id),
        lambda: other.responses.delete(first.id),
        lambda: other.responses.create(model=SMOL, input="Hi", previous_response_id=first.id, max_output_tokens=2),
    ):
        with pytest.raises(openai.NotFoundError):
            attempt()
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError) as gone:
        client.responses.retrieve(first.id)
    assert first.id in gone.value.body["message"]
    labelled = client.responses.create(
        model=SMOL, input="Hi", metadata={"order": "42"}, service_tier="flex", user="ann", max_output_tokens=2
    )
    kept = client.responses.retrieve(labelled.id)
    assert kept.metadata == {"order": "42"} and kept.service_tier == "flex" and kept.user == "ann"
    unstored = client.responses.create(model=SMOL, input="Hi", store=False, max_output_tokens=2)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


@pytest.mark.parametrize(
    ("extra", "param", "words"),
    [
        ({"reasoning": {"effort": "low"}}, "reasoning", "not supported"),
        ({"include": ["message.output_text.logprobs"]}, "include", "not supported"),
        ({"background": True}, "background", "not supported"),
        ({"tools": [{"type": "web_search"}]}, "tools", "'web_search'"),
        ({"tools": [{"type": "file_search", "vector_store_ids": ["vs_1"]}]}, "tools", "'file_search'"),
        ({"input": [{"type": "reasoning", "id": "rs_1", "summary": []}]}, "input", "'reasoning'"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "https://x/y.png"}]}]},
            "input",
            "'input_image'",
        ),
        ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}, "input", "'input_file'"),
        ({"tool_choice": {"type": "web_search_preview"}}, "tool_choice", ""),
        ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text", "text.format.schema"),
        ({"frequency_penalty": 1}, "frequency_penalty", "Unrecognized request argument"),
        ({"previous_response_id": "resp_nope"}, "previous_response_id", "resp_nope"),
        ({"model": "nope"}, "model", "nope"),
        ({"input": None}, "input", "input"),
        ({"input": [{"role": "assistant", "content": "Hi", "phase": "final_answer"}]}, "input", "not supported"),
        ({"truncation": "auto"}, "truncation", ""),
        ({"metadata": {"k": "v" * 513}}, "metadata", ""),
        ({"max_output_tokens": 100000}, "max_output_tokens", "max_output_tokens"),
    ],
)
def test_what_is_not_served_is_refused_naming_it(server, extra, param, words):
    body = {"model": SMOL, "input": "Hi", "max_output_tokens": 2} | extra
    answer = server.http().post("/v1/responses", json=body)
    assert answer.status_code in (400, 404), answer.text
    error = answer.json()["error"]
    assert error["param"] == param and words in error["message"], error


def test_tools_on_a_model_without_tool_support_are_refused(client):
    with pytest.raises(openai.BadRequestError) as raised:
        client.responses.create(model=SMOL, input=WEATHER_ASK, tools=[WEATHER], max_output_tokens=4)
    assert raised.value.body["param"] == "tools" and SMOL in raised.value.body["message"]


def test_a_client_without_a_key_is_refused(server):
    assert httpx.post(f"{server.url}/v1/responses", json={"input": "Hi"}).status_code == 401


def test_a_client_that_leaves_mid_stream_frees_its_request(server, client):
    with client.responses.create(model=SMOL, input="Count to fifty.", max_output_tokens=200, stream=True) as stream:
        for event in stream:
            if event.type == "response.output_text.delta":
                break
    server.wait_idle()
