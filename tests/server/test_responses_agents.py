"""The OpenAI Agents SDK (its default model is the Responses API) against a live server on Qwen2.5: an agent with
a function tool calls it (the first turn forced with tool_choice "required", which the SDK resets after a tool
ran), reads the result and answers, whole and streamed."""

import asyncio

import agents
import openai
import pytest
from live_server import LiveServer

QWEN = "qwen2.5-coder-0.5b"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    live = LiveServer("--model", QWEN, home=str(tmp_path_factory.mktemp("home")))
    yield live
    live.stop()


@pytest.fixture(scope="module")
def weather_agent(server):
    agents.set_tracing_disabled(True)
    agents.set_default_openai_api("responses")
    asked = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        asked.append(city)
        return f"Sunny and 21 degrees in {city}."

    agent = agents.Agent(
        name="weather",
        instructions="Answer questions about the weather with the get_weather tool.",
        model=QWEN,
        tools=[get_weather],
        model_settings=agents.ModelSettings(
            tool_choice="required", parallel_tool_calls=False, temperature=0, max_tokens=40
        ),
    )
    return agent, asked


def on_carpool(server, run):
    """`run()` in a fresh event loop, with a client of its own: an async client's connections belong to one loop."""

    async def with_client():
        client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        agents.set_default_openai_client(client, use_for_tracing=False)
        async with client:
            return await run()

    return asyncio.run(with_client())


def test_an_agent_calls_its_tool_and_answers(server, weather_agent):
    agent, asked = weather_agent
    result = on_carpool(server, lambda: agents.Runner.run(agent, "What is the weather in Paris?", max_turns=4))
    assert asked[-1] == "Paris" and isinstance(result.final_output, str) and result.final_output
    kinds = [item.type for item in result.new_items]
    assert kinds[:2] == ["tool_call_item", "tool_call_output_item"] and kinds[-1] == "message_output_item"
    # Every model response came from carpool's Responses API, usage included.
    assert all(r.response_id.startswith("resp_") and r.usage.output_tokens for r in result.raw_responses)


def test_a_streamed_agent_run_completes(server, weather_agent):
    agent, asked = weather_agent

    async def run():
        streamed = agents.Runner.run_streamed(agent, "What is the weather in Rome?", max_turns=4)
        kinds = [event.type async for event in streamed.stream_events()]
        return streamed, kinds

    streamed, kinds = on_carpool(server, run)
    assert asked[-1] == "Rome" and streamed.final_output and "raw_response_event" in kinds


def test_a_run_chained_by_previous_response_id(server, weather_agent):
    """The SDK sends each later turn as only its new items and the previous response's id: carpool's store
    supplies the rest of the conversation."""
    agent, asked = weather_agent
    result = on_carpool(
        server,
        lambda: agents.Runner.run(agent, "What is the weather in Oslo?", max_turns=4, auto_previous_response_id=True),
    )
    assert asked[-1] == "Oslo" and result.final_output and len(result.raw_responses) >= 2
    first, last = result.raw_responses[0].response_id, result.raw_responses[-1].response_id
    assert server.client().responses.retrieve(last).previous_response_id not in (None, last)
    assert result.last_response_id == last and server.client().responses.retrieve(first).status == "completed"
