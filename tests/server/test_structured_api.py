"""Structured outputs and tool calling with the official `openai` SDK against a live server on SmolLM2 and
Qwen2.5: every constrained output parses and validates, tool calls come back as `tool_calls` (whole and
streamed), and bad constraints are 400s naming the parameter."""

import asyncio
import json
import re
import sqlite3
import sys
from pathlib import Path

import httpx
import openai
import pytest
from live_server import LiveServer
from prometheus_client.parser import text_string_to_metric_families
from pydantic import BaseModel, Field

from carpool.server.app import create_app

sys.path.insert(0, str(Path(__file__).parent / "batch"))
from batch_server import chat_line, result_lines, submit, wait_for_end

SMOL, QWEN = "smollm2-135m", "qwen2.5-coder-0.5b"
ASK = [{"role": "user", "content": "Describe a person called Ann who is 30."}]


class Person(BaseModel):
    name: str = Field(max_length=12)
    age: int


PERSON_SCHEMA = Person.model_json_schema() | {"additionalProperties": False}


WEATHER = {
    "type": "function",
    "function": {
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
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "additionalProperties": False,
            "required": ["zone"],
            "properties": {"zone": {"type": "string", "maxLength": 12}},
        },
    },
}
WEATHER_ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    live = LiveServer(
        "--model", SMOL, "--model", QWEN, "--max-num-seqs", "4", home=str(tmp_path_factory.mktemp("home"))
    )
    yield live
    live.stop()


@pytest.fixture(scope="module")
def client(server):
    return server.client()


def check_weather_call(call, name="get_weather") -> None:
    assert call.type == "function" and call.function.name == name and call.id.startswith("call_")
    arguments = json.loads(call.function.arguments)
    if name == "get_weather":
        assert set(arguments) == {"city", "unit"} and arguments["unit"] in ("celsius", "fahrenheit")
    else:
        assert set(arguments) == {"zone"}


@pytest.mark.parametrize("model", [SMOL, QWEN])
def test_parse_with_a_pydantic_model(client, model):
    completion = client.chat.completions.parse(
        model=model, messages=ASK, response_format=Person, max_tokens=40, temperature=0
    )
    person = completion.choices[0].message.parsed
    assert isinstance(person, Person) and completion.choices[0].finish_reason == "stop"


def test_json_object(client):
    """On Qwen: SmolLM2 given any object to write keeps adding keys past a small max_tokens."""
    short = [{"role": "user", "content": "Return a JSON object with one key, age, for a 30 year old."}]
    obj = client.chat.completions.create(
        model=QWEN, messages=short, max_tokens=60, temperature=0, response_format={"type": "json_object"}
    )
    assert isinstance(json.loads(obj.choices[0].message.content), dict), obj


@pytest.mark.parametrize("model", [SMOL, QWEN])
def test_regex_and_choice(client, model):
    regex = client.chat.completions.create(
        model=model,
        messages=ASK,
        max_tokens=10,
        temperature=0.8,
        seed=3,
        n=2,
        extra_body={"guided_regex": r"[A-Z][a-z]{1,6} [0-9]{2}"},
    )
    for choice in regex.choices:
        assert re.fullmatch(r"[A-Z][a-z]{1,6} [0-9]{2}", choice.message.content)
    choice = client.completions.create(
        model=model,
        prompt="The best colour is",
        max_tokens=5,
        extra_body={"structured_outputs": {"choice": ["red", "blue"]}},
    )
    assert choice.choices[0].text in ("red", "blue")


def test_json_schema_stream_concatenates_to_valid_json(client):
    stream = client.chat.completions.create(
        model=SMOL,
        messages=ASK,
        max_tokens=40,
        temperature=0,
        stream=True,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "person", "strict": True, "schema": PERSON_SCHEMA},
        },
    )
    Person.model_validate_json("".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices))


def test_required_and_named_tool_calls_parse_against_the_schema(client):
    required = client.chat.completions.create(
        model=QWEN, messages=WEATHER_ASK, tools=[WEATHER, TIME], tool_choice="required", max_tokens=60, temperature=0
    )
    choice = required.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    for call in choice.message.tool_calls:
        check_weather_call(call, call.function.name)
    named = client.chat.completions.create(
        model=QWEN,
        messages=WEATHER_ASK,
        tools=[WEATHER, TIME],
        max_tokens=60,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        parallel_tool_calls=False,
        temperature=0,
    )
    [call] = named.choices[0].message.tool_calls
    check_weather_call(call, "get_time")


def test_a_required_call_ends_after_the_call_instead_of_repeating_it_until_max_tokens(client):
    response = client.chat.completions.create(
        model=QWEN, messages=WEATHER_ASK, tools=[WEATHER], tool_choice="required", max_tokens=150, temperature=0
    )
    assert response.choices[0].finish_reason == "tool_calls" and response.choices[0].message.tool_calls
    assert response.usage.completion_tokens < 75  # one call is about 25 tokens; the model may not be forced on


def test_streamed_tool_calls_and_the_tool_result_turn(client):
    stream = client.chat.completions.create(
        model=QWEN,
        messages=WEATHER_ASK,
        tools=[WEATHER],
        max_tokens=60,
        tool_choice="required",
        temperature=0,
        stream=True,
    )
    calls, finish = {}, None
    for chunk in stream:
        for delta in chunk.choices[0].delta.tool_calls or []:
            calls.setdefault(delta.index, delta)
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and calls
    call = calls[0]
    check_weather_call(call)
    turn = {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": call.id,
                "type": "function",
                "function": {"name": "get_weather", "arguments": call.function.arguments},
            }
        ],
    }
    result = {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21}'}
    answer = client.chat.completions.create(
        model=QWEN, messages=WEATHER_ASK + [turn, result], tools=[WEATHER], max_tokens=12, temperature=0
    )
    assert answer.choices[0].message.content and not answer.choices[0].message.tool_calls


def test_a_model_without_tool_support_is_400_naming_it(client):
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(model=SMOL, messages=WEATHER_ASK, tools=[WEATHER], max_tokens=4)
    assert raised.value.body["param"] == "tools" and SMOL in raised.value.body["message"]
    ignored = client.chat.completions.create(
        model=SMOL, messages=WEATHER_ASK, tools=[WEATHER], tool_choice="none", max_tokens=4
    )
    assert ignored.choices[0].message.tool_calls is None


@pytest.mark.parametrize(
    ("fields", "param", "words"),
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {
                        "name": "x",
                        "schema": {"type": "object", "properties": {"a": {"not": {"type": "string"}}}},
                    },
                }
            },
            "response_format",
            "not",
        ),
        ({"guided_regex": "(a"}, "guided_regex", "unclosed group"),
        ({"guided_regex": "a" * 70_000}, "guided_regex", "at most"),
        ({"guided_choice": ["a"], "guided_regex": "a"}, "guided_choice", "only one"),
        ({"guided_choice": ["yes"], "min_tokens": 2}, "min_tokens", "structured"),
        ({"guided_regex": "yes", "bad_words": ["yes"]}, "bad_words", "structured"),
        (
            {"tool_choice": {"type": "function", "function": {"name": "nope"}}, "tools": [WEATHER]},
            "tool_choice",
            "nope",
        ),
        (
            {
                "tool_choice": "required",
                "tools": [
                    {
                        "type": "function",
                        "function": {
                            "name": f"f{i}",
                            "parameters": {
                                "type": "object",
                                "properties": {f"p{j}": {"type": "string"} for j in range(40)},
                            },
                        },
                    }
                    for i in range(128)
                ],
            },
            "tools",
            "at most",
        ),
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {"name": "f", "parameters": {"type": "object", "properties": {"a": {"type": 5}}}},
                    }
                ]
            },
            "tools",
            "tools[0].function.parameters: invalid",
        ),  # tool_choice "auto" checks the tools as "required" does
        (
            {
                "tools": [WEATHER, {"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}],
                "tool_choice": "auto",
            },
            "tools",
            'tools[1].function.parameters must be a JSON schema of type "object"',
        ),
    ],
)
def test_bad_constraints_are_400_naming_the_parameter(client, fields, param, words):
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(model=QWEN, messages=ASK, max_tokens=4, extra_body=fields)
    assert raised.value.body["param"] == param and words in raised.value.body["message"], raised.value.body


def test_a_batch_line_with_response_format(client):
    schema = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON_SCHEMA}}
    batch = submit(
        client,
        [
            chat_line(f"p{i}", f"Describe person {i}.", max_tokens=40, model=SMOL, response_format=schema)
            for i in range(2)
        ],
    )
    batch = wait_for_end(client, batch.id)
    assert batch.status == "completed", batch
    for line in result_lines(client, batch.output_file_id):
        Person.model_validate_json(line["response"]["body"]["choices"][0]["message"]["content"])


def structured_count(server, model: str, kind: str) -> float:
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "carpool:structured_requests_total" and sample.labels == {"model_name": model, "kind": kind}
    )


def test_metrics_count_constrained_requests_once_each(server, client):
    before = {kind: structured_count(server, SMOL, kind) for kind in ("choice", "json")}
    client.chat.completions.create(model=SMOL, messages=ASK, max_tokens=2, n=2, extra_body={"guided_choice": ["a"]})
    client.chat.completions.create(model=SMOL, messages=ASK, max_tokens=2)
    assert structured_count(server, SMOL, "choice") == before["choice"] + 1
    assert structured_count(server, SMOL, "json") == before["json"]


def test_the_ledger_names_each_constrained_requests_kind(server, client):
    asks = [
        {"extra_body": {"guided_choice": ["a"]}},
        {"response_format": {"type": "json_object"}},
        {"extra_body": {"guided_json": PERSON_SCHEMA}},
        {},
    ]
    for ask in asks:
        client.chat.completions.create(model=SMOL, messages=ASK, max_tokens=2, **ask)
    client.chat.completions.create(
        model=QWEN, messages=WEATHER_ASK, tools=[WEATHER], tool_choice="required", max_tokens=40, temperature=0
    )
    ledger = sqlite3.connect(Path(server.home) / "carpool.db")
    kinds = [kind for (kind,) in ledger.execute("SELECT constraint_kind FROM ledger ORDER BY rowid DESC LIMIT 5")]
    assert kinds[::-1] == ["choice", "json_object", "json_schema", None, "tools"]


def test_auto_tool_choice_parses_the_call_the_model_writes(client):
    """Qwen2.5-Coder 0.5B writes a bare call (no <tool_call> tags) for this question, whole or streamed."""
    whole = client.chat.completions.create(
        model=QWEN, messages=WEATHER_ASK, tools=[WEATHER, TIME], max_tokens=60, temperature=0
    )
    [call] = whole.choices[0].message.tool_calls
    check_weather_call(call)
    assert whole.choices[0].finish_reason == "tool_calls" and not whole.choices[0].message.content
    stream = client.chat.completions.create(
        model=QWEN, messages=WEATHER_ASK, tools=[WEATHER, TIME], max_tokens=60, temperature=0, stream=True
    )
    deltas = [chunk.choices[0].delta for chunk in stream if chunk.choices]
    [streamed] = [call for delta in deltas for call in delta.tool_calls or []]
    assert streamed.function.arguments == call.function.arguments
    assert not "".join(delta.content or "" for delta in deltas)
    assert all(delta.content != "" for delta in deltas)  # OpenAI sends null beside calls, nothing for held text


def test_a_new_constraint_compiles_off_the_event_loop(engine, monkeypatch):
    """On the loop, a compile stalls every stream (a 64 KB schema: 20-50 ms; the first tokenizer table: 0.2-0.7 s)."""
    compile, misses_on_loop = engine.engine.grammars.compile, []

    def recording(*args):
        before = compile.cache_info().misses
        compiled = compile(*args)
        try:
            asyncio.get_running_loop()
            misses_on_loop.append(compile.cache_info().misses - before)
        except RuntimeError:  # a worker thread: no loop runs here
            pass
        return compiled

    monkeypatch.setattr(engine.engine.grammars, "compile", recording)

    async def send():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(engine)), base_url="http://c") as c:
            return await c.post(
                "/v1/completions", json={"prompt": "Code:", "max_tokens": 4, "guided_regex": "[0-9]{3}-off-loop"}
            )

    assert asyncio.run(send()).status_code == 200
    assert misses_on_loop == [0]  # the start on the loop found it compiled
