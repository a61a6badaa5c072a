"""`cache_control` breakpoints as token counts, on the session's model in process: each breakpoint is the prompt
prefix that ends with its block (tools, system blocks, message blocks, a top-level one on the last block), the
engine request carries them, and the rules on count and TTL order; plus the stop reasons and the error classes
of the official SDK for every status the server answers."""

import asyncio
from types import SimpleNamespace

import anthropic
import pytest
from fastapi import FastAPI, Request
from live_server import ServedApp

from carpool.economics.contract import Principal, UsageRecord
from carpool.engine.outputs import RequestOutput
from carpool.engine.request import CacheBreakpoint
from carpool.models.loader import resolve_model_dir
from carpool.models.tokenizer import Tokenizer
from carpool.server.admission import TierQueues
from carpool.server.anthropic.caching import marks
from carpool.server.anthropic.convert import cache_breakpoints, checked_chat_request, start_message
from carpool.server.anthropic.errors import AnthropicErrors
from carpool.server.anthropic.format import MessageFormat
from carpool.server.anthropic.protocol import MessagesRequest
from carpool.server.errors import APIError, install_error_handlers
from carpool.server.generation import Backends
from carpool.server.metrics import ServerMetrics
from carpool.server.open_gate import RecordingGate
from carpool.server.serving import ModelServing, Serving

SYSTEM = ["You are a careful assistant who answers questions about the weather.", "Always answer in English."]
FIRST, SECOND = "What is the weather like in Paris today?", "And in Rome tomorrow, please?"


def _request(**fields) -> MessagesRequest:
    body = {
        "model": "m",
        "max_tokens": 2,
        "system": [{"type": "text", "text": text} for text in SYSTEM],
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": FIRST}, {"type": "text", "text": SECOND}]},
        ],
    }
    return MessagesRequest.model_validate(body | fields)


@pytest.fixture
def serving(engine):
    return Serving([Backends(engine, RecordingGate(), ServerMetrics(["m"]).models["m"], TierQueues(4), "m")])


def _marked(request: MessagesRequest, where: str, ttl: str | None = None) -> MessagesRequest:
    control = {"type": "ephemeral"} | ({"ttl": ttl} if ttl else {})
    body = request.model_dump(exclude_none=True)
    if where.startswith("system"):
        body["system"][int(where[-1])]["cache_control"] = control
    else:
        body["messages"][0]["content"][int(where[-1])]["cache_control"] = control
    return MessagesRequest.model_validate(body)


def _prefix_text(serving, request: MessagesRequest, breakpoint: CacheBreakpoint) -> str:
    model = serving.model("m")
    ids = model.chat_prompt_ids(checked_chat_request(request))
    assert 0 < breakpoint.num_tokens <= len(ids)
    return model.tokenizer.decode(ids[: breakpoint.num_tokens])


def test_each_breakpoint_is_the_prefix_that_ends_with_its_block(serving):
    model = serving.model("m")
    for where, last_text in (("system0", SYSTEM[0]), ("system1", SYSTEM[1]), ("message0", FIRST)):
        request = _marked(_request(), where, "1h")
        [breakpoint] = cache_breakpoints(request, model, checked_chat_request(request))
        assert breakpoint.ttl_seconds == 3600
        text = _prefix_text(serving, request, breakpoint)
        # The prefix holds the marked block whole (its last token may merge with what follows) and nothing after.
        assert last_text[:-1] in text and SECOND not in text
        if where != "message0":
            assert FIRST not in text
    # The last block of the conversation: everything but the generation prompt.
    request = _request(cache_control={"type": "ephemeral"})
    [breakpoint] = cache_breakpoints(request, model, checked_chat_request(request))
    full = model.chat_prompt_ids(checked_chat_request(request))
    assert breakpoint.ttl_seconds == 300 and SECOND in _prefix_text(serving, request, breakpoint)
    assert breakpoint.num_tokens < len(full)


def test_breakpoints_reach_the_engine_request_in_prompt_order(serving):
    async def started(request: MessagesRequest):
        gen, _ = start_message(serving, request, Principal())
        gen.cancel()
        await gen.done.wait()
        return gen.choices[0].request

    # Past the minimum cacheable prefix (1024 tokens by default), below which the door drops a breakpoint.
    long_system = [{"type": "text", "text": "The weather is mild and dry today. " * 200}, {"type": "text", "text": "x"}]
    request = _marked(_marked(_request(system=long_system), "system0", "1h"), "message1")
    engine_request = asyncio.run(started(request))
    breakpoints = engine_request.cache_breakpoints
    assert [b.ttl_seconds for b in breakpoints] == [3600, 300]
    assert breakpoints[0].num_tokens < breakpoints[1].num_tokens <= len(engine_request.prompt_token_ids)
    assert asyncio.run(started(_request())).cache_breakpoints == ()


def test_breakpoint_rules():
    hour, five = {"type": "ephemeral", "ttl": "1h"}, {"type": "ephemeral"}
    tools = [{"name": f"t{i}", "input_schema": {"type": "object"}, "cache_control": hour} for i in range(2)]
    request = _request(tools=tools, cache_control=five)
    assert [m.where for m in marks(request)] == ["tools[0]", "tools[1]", "messages[0].content[1]"]
    request = _marked(_marked(_request(tools=tools), "system0", "1h"), "message0")
    assert len(marks(request)) == 4
    with pytest.raises(APIError, match=r"messages\[0\].content\[1\].cache_control: at most 4"):
        marks(_marked(request, "message1"))
    with pytest.raises(APIError, match="may not come after a shorter one"):
        marks(_marked(_marked(_request(), "system0"), "message0", "1h"))
    # A top-level cache_control on a block that has one already is that one breakpoint, unless the TTLs differ.
    assert len(marks(_marked(_request(cache_control=five), "message1"))) == 1
    with pytest.raises(APIError, match="another ttl"):
        marks(_marked(_request(cache_control=hour), "message1"))


def test_stop_reasons(tokenizer):
    fmt = MessageFormat(tokenizer, None, ["lo w"])
    ids = tokenizer.encode("Hello world", add_special_tokens=False)

    def output(text: str, reason: str) -> RequestOutput:
        return RequestOutput("r", [1], ids, text, True, reason)

    assert fmt.stop_reason(output("Hello world", "stop"), False) == ("end_turn", None)
    assert fmt.stop_reason(output("Hel", "stop"), False) == ("stop_sequence", "lo w")
    assert fmt.stop_reason(output("Hello world", "length"), True) == ("max_tokens", None)
    assert fmt.stop_reason(output("Hello world", "stop"), True) == ("tool_use", None)


@pytest.mark.parametrize(
    ("status", "error_class", "kind"),
    [
        (400, anthropic.BadRequestError, "invalid_request_error"),
        (401, anthropic.AuthenticationError, "authentication_error"),
        (403, anthropic.PermissionDeniedError, "permission_error"),
        (404, anthropic.NotFoundError, "not_found_error"),
        (413, anthropic.ContentTooLargeError, "request_too_large"),
        (429, anthropic.RateLimitError, "rate_limit_error"),
        (500, anthropic.InternalServerError, "api_error"),
        (503, anthropic.ServiceUnavailableError, "overloaded_error"),
    ],
)
def test_every_status_reaches_the_sdk_as_its_error_class(status, error_class, kind):
    app = FastAPI()
    install_error_handlers(app)
    app.add_middleware(AnthropicErrors)

    @app.post("/v1/messages")
    async def refuse(request: Request):
        raise APIError(status, f"refused with {status}")

    with ServedApp(app) as http:
        client = anthropic.Anthropic(base_url=str(http.base_url), api_key="k", max_retries=0)
        with pytest.raises(error_class) as raised:
            client.messages.create(model="m", max_tokens=1, messages=[{"role": "user", "content": "x"}])
    assert raised.value.body == {"type": "error", "error": {"type": kind, "message": f"refused with {status}"}}


def test_an_unhandled_error_is_an_api_error_500_with_a_request_id():
    app = FastAPI()
    install_error_handlers(app)
    app.add_middleware(AnthropicErrors)

    @app.post("/v1/messages")
    async def broken(request: Request):
        raise RuntimeError("bug")

    with ServedApp(app) as http:
        answer = http.post("/v1/messages", json={})
    assert answer.status_code == 500 and answer.json()["error"]["type"] == "api_error"
    assert "request-id" in answer.headers


class _TokenizerOnly:
    """What ModelServing reads of an engine to render and count a chat prompt: its tokenizer, no weights."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.door = self  # the engine's door, as far as tokenizing goes

    def tokenize_prompt(self, prompt: str) -> list[int]:
        return self.tokenizer.encode(prompt)


TOOLS = [
    {"name": "get_weather", "description": "The weather in a city", "input_schema": {"type": "object"}},
    {"name": "get_time", "description": "The time in a zone", "input_schema": {"type": "object"}},
]


@pytest.mark.parametrize("system", [None, SYSTEM[0]])
def test_a_tool_breakpoint_ends_with_its_tool_in_qwens_template(system):
    """Qwen renders the tools inside the system turn, after the system text: a breakpoint on the last tool ends
    with the tools, not with the whole prompt, with a system prompt or without one."""
    tokenizer = Tokenizer.from_dir(resolve_model_dir("qwen2.5-coder-0.5b"))
    model = ModelServing(Backends(_TokenizerOnly(tokenizer), RecordingGate(), None, TierQueues(4), "m"))
    for marked in (0, 1):
        tools = [
            tool | ({"cache_control": {"type": "ephemeral"}} if i == marked else {}) for i, tool in enumerate(TOOLS)
        ]
        request = _request(tools=tools, system=system) if system else _request(tools=tools, system=None)
        chat = checked_chat_request(request)
        [breakpoint] = cache_breakpoints(request, model, chat)
        text = tokenizer.decode(model.chat_prompt_ids(chat)[: breakpoint.num_tokens])
        assert TOOLS[marked]["description"] in text and FIRST not in text
        assert (TOOLS[1]["description"] in text) == (marked == 1)


def test_usage_splits_the_prompt_into_reads_writes_by_ttl_and_the_rest(tokenizer):
    record = UsageRecord(
        request_id="chatcmpl-1",
        model="m",
        tier="batch",
        prompt_tokens=3000,
        cached_tokens=1200,
        cache_write_tokens=1500,
        output_tokens=7,
        queue_seconds=0,
        prefill_seconds=0,
        decode_seconds=0,
        finish_reason="stop",
        cache_write_5m_tokens=500,
        cache_write_1h_tokens=1000,
    )
    usage = MessageFormat.usage(SimpleNamespace(usage_record=lambda: record))
    assert usage == {
        "input_tokens": 300,
        "cache_creation_input_tokens": 1500,
        "cache_read_input_tokens": 1200,
        "cache_creation": {"ephemeral_5m_input_tokens": 500, "ephemeral_1h_input_tokens": 1000},
        "output_tokens": 7,
        "service_tier": "batch",
    }


def test_marks_that_end_at_one_token_are_one_breakpoint_for_the_door():
    """Qwen renders the tools after the system text: a breakpoint on the last tool and one on the last system
    block both end the system turn. The door takes ascending prefixes with TTLs that never grow."""
    tokenizer = Tokenizer.from_dir(resolve_model_dir("qwen2.5-coder-0.5b"))
    model = ModelServing(Backends(_TokenizerOnly(tokenizer), RecordingGate(), None, TierQueues(4), "m"))
    tools = [TOOLS[0], TOOLS[1] | {"cache_control": {"type": "ephemeral", "ttl": "1h"}}]
    system = [{"type": "text", "text": SYSTEM[0], "cache_control": {"type": "ephemeral"}}]
    request = _request(tools=tools, system=system, cache_control={"type": "ephemeral"})
    chat = checked_chat_request(request)
    breakpoints = cache_breakpoints(request, model, chat)
    assert [point.ttl_seconds for point in breakpoints] == [3600, 300]
    assert breakpoints[0].num_tokens < breakpoints[1].num_tokens < len(model.chat_prompt_ids(chat))
