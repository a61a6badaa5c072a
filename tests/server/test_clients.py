"""Client libraries as users run them, pinned in requirements-dev.txt, against a live server on Qwen2.5-Coder 0.5B
(SmolLM2's chat template has no tools): pydantic-ai (an agent with a tool and a structured output), LangChain
(`bind_tools`, `with_structured_output` both ways) and LiteLLM (a chat and a tool call), with the openai SDK for
nested schemas under every tool_choice and parallel calls. Each schema is a nested pydantic model (its JSON schema
has `$defs`), and each result must validate against its model. The model is tiny and greedy: constrained decoding
guarantees the shape, not the sense, so the tests check shapes. instructor runs in a venv of its own (no release
installs beside openai 3.51: requirements-instructor.txt), as a script against the same server."""

import json
import subprocess
from enum import Enum
from pathlib import Path

import pytest
from live_server import LiveServer
from pydantic import BaseModel, Field

QWEN = "qwen2.5-coder-0.5b"
ROOT = Path(__file__).resolve().parents[2]
INSTRUCTOR_PYTHON = ROOT / ".venv" / "instructor" / "bin" / "python"  # `make test` builds it


class Unit(str, Enum):
    celsius = "celsius"
    fahrenheit = "fahrenheit"


class Place(BaseModel):
    city: str = Field(max_length=20)
    unit: Unit


class Forecast(BaseModel):
    """Nested (`$defs` for Place and Unit), a list, an enum and an optional field: what every client sends."""

    places: list[Place] = Field(max_length=2)
    note: str | None = Field(None, max_length=20)


PARIS = [{"role": "user", "content": "What is the weather in Paris?"}]
CITY = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20}},
    "required": ["city"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    live = LiveServer("--model", QWEN, "--max-num-seqs", "4", home=str(tmp_path_factory.mktemp("home")))
    yield live
    live.stop()


@pytest.fixture(scope="module")
def base_url(server):
    return f"{server.url}/v1"


def function(name: str, parameters: dict, description: str = "") -> dict:
    return {"type": "function", "function": {"name": name, "description": description, "parameters": parameters}}


@pytest.mark.parametrize("tool_choice", ["auto", "required", {"type": "function", "function": {"name": "forecast"}}])
def test_nested_pydantic_tool_parameters_under_every_tool_choice(server, tool_choice):
    """Before issue 48 every one of these was a 400: "Pointer '/$defs/Place' does not exist". Under "auto" the
    model may answer in words (this one does); whatever calls it makes validate."""
    completion = server.client().chat.completions.create(
        model=QWEN,
        messages=PARIS,
        tools=[function("forecast", Forecast.model_json_schema(), "The forecast for some places")],
        tool_choice=tool_choice,
        max_tokens=60,
        temperature=0,
    )
    calls = completion.choices[0].message.tool_calls or []
    assert calls or tool_choice == "auto", completion
    for call in calls:
        Forecast.model_validate_json(call.function.arguments)


def test_parallel_calls_under_required_are_not_capped_at_one(server):
    """Asked for two cities, the model writes two calls (and, being tiny, goes on to other cities until max_tokens:
    the whole calls of the cut block are still calls); without parallel_tool_calls, exactly one."""
    ask = [{"role": "user", "content": "What is the weather in Paris and in Rome?"}]
    tools = [function("get_weather", CITY, "The weather in one city")]
    counts = {}
    for parallel in (True, False):
        completion = server.client().chat.completions.create(
            model=QWEN,
            messages=ask,
            tools=tools,
            tool_choice="required",
            parallel_tool_calls=parallel,
            max_tokens=40,
            temperature=0,
        )
        calls = completion.choices[0].message.tool_calls or []
        counts[parallel] = [json.loads(call.function.arguments)["city"] for call in calls]
    assert counts[True][:2] == ["Paris", "Rome"] and counts[False] == ["Paris"], counts


def test_pydantic_ai_agent_with_a_tool_and_a_structured_output(base_url):
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider
    from pydantic_ai.settings import ModelSettings

    model = OpenAIChatModel(QWEN, provider=OpenAIProvider(base_url=base_url, api_key="unused"))
    settings = ModelSettings(max_tokens=60, temperature=0, parallel_tool_calls=False)
    agent = Agent(model, output_type=Forecast, model_settings=settings)
    asked = []

    async def once(ctx, tool):
        """Qwen2.5-Coder 0.5B given the weather asks for it again, every turn, until pydantic-ai's request limit
        (50): the tool is offered until it has answered, then only the output tool is left."""
        return None if asked else tool

    @agent.tool_plain(prepare=once)
    def get_weather(city: str) -> str:
        """The weather in a city."""
        asked.append(city)
        return "sunny, 20 celsius"

    result = agent.run_sync("What is the weather in Paris? Use get_weather, then answer.")
    assert isinstance(result.output, Forecast) and asked == ["Paris"], (result.output, asked)
    Forecast.model_validate(result.output.model_dump())


def test_langchain_bind_tools_and_with_structured_output(base_url):
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(base_url=base_url, api_key="unused", model=QWEN, temperature=0, max_tokens=60)
    message = llm.bind_tools([Place], tool_choice="required").invoke("What is the weather in Paris?")
    assert message.tool_calls, message  # one or more: parallel calls are allowed, and this model lists on
    for call in message.tool_calls:
        assert call["name"] == "Place"
        Place.model_validate(call["args"])
    for method in ("json_schema", "function_calling"):
        forecast = llm.with_structured_output(Forecast, method=method).invoke("The forecast for Paris.")
        assert isinstance(forecast, Forecast), (method, forecast)


def test_litellm_chat_and_tool_call(base_url, monkeypatch):
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # its price list, from the package: no download
    import litellm

    options = {"model": f"openai/{QWEN}", "api_base": base_url, "api_key": "unused", "temperature": 0}
    chat = litellm.completion(messages=[{"role": "user", "content": "Say hi."}], max_tokens=8, **options)
    assert chat.choices[0].message.content and chat.usage.completion_tokens <= 8
    tool = function("forecast", Forecast.model_json_schema())
    answer = litellm.completion(messages=PARIS, tools=[tool], tool_choice="required", max_tokens=60, **options)
    calls = answer.choices[0].message.tool_calls
    assert calls, answer
    for call in calls:
        Forecast.model_validate_json(call.function.arguments)


def test_instructor_tools_and_json_schema_modes(base_url):
    assert INSTRUCTOR_PYTHON.exists(), (
        "instructor's venv is missing: `make test` builds it (requirements-instructor.txt)"
    )
    script = Path(__file__).with_name("instructor_client.py")
    done = subprocess.run(
        [str(INSTRUCTOR_PYTHON), str(script), base_url, QWEN], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    results = [json.loads(line) for line in done.stdout.splitlines()]
    assert [r["mode"] for r in results] == ["tool_call", "json_schema_mode"], results
    for result in results:
        Forecast.model_validate(result["forecast"])
