"""A Messages request as the chat pipeline's own request (ChatCompletionRequest), so it runs through the same
checks, tool grammars, tiers, gate and ledger as /v1/chat/completions; and the start of one.

Blocks become chat turns as the chat templates expect them: the system blocks one system turn (joined by
newlines), a user message's `tool_result` blocks one `tool` turn each (their text; an `is_error` result is
prefixed "Error: "), its text blocks one user turn, and an assistant message's text and `tool_use` blocks one
assistant turn with `tool_calls`.
"""

import json
import re
from contextlib import contextmanager

from pydantic import ValidationError

from carpool.economics.contract import Principal
from carpool.engine.request import CacheBreakpoint
from carpool.engine.tiers import BATCH_TIER, DEFAULT_TIER
from carpool.server.anthropic.caching import common_prefix_length, cut, marks
from carpool.server.anthropic.format import MessageFormat
from carpool.server.anthropic.protocol import (
    CountTokensRequest,
    MessageParam,
    MessagesRequest,
    TextBlock,
    ToolResultBlock,
    ToolUseBlock,
)
from carpool.server.errors import APIError
from carpool.server.generation import Generation
from carpool.server.protocol import ChatCompletionRequest
from carpool.server.serving import ModelServing, Serving

# Anthropic's tier names: carpool never moves a request to another tier on its own, so both are its default tier.
_ANTHROPIC_TIERS = {"auto": DEFAULT_TIER, "standard_only": DEFAULT_TIER}


def requested_tier(request: MessagesRequest) -> str:
    """`service_tier` as a carpool tier. Anthropic's "auto" (the default) and "standard_only" are both carpool's
    default tier: "auto" at Anthropic may use Priority Tier capacity a customer has bought, which carpool sells as
    a tier of its own that a request names. carpool's live tiers ("priority", "default", "flex") may be named
    directly, an extension. The batch tier is set by the batch runner only (no body can name it)."""
    tier = request.service_tier
    if tier is None:
        return DEFAULT_TIER
    return _ANTHROPIC_TIERS.get(tier, tier)


def check_conversation(request: CountTokensRequest) -> None:
    """The rules on the order of messages and blocks that the body's types cannot state: 400 naming the field.

    Roles alternate, starting and ending with a user message (an assistant message last, Anthropic's prefill, is
    not supported). Each `tool_use` is answered by a `tool_result` in the next user message, whose results come
    before its text, and each `tool_result` answers a `tool_use` of the message before it."""
    messages = request.messages
    for i, message in enumerate(messages):
        expected = "user" if i % 2 == 0 else "assistant"
        if message.role != expected:
            raise APIError(
                400,
                f"messages[{i}].role: roles must alternate, starting with user; expected {expected!r}, "
                f"got {message.role!r}",
                param="messages",
            )
    if messages[-1].role != "user":
        raise APIError(
            400,
            f"messages[{len(messages) - 1}].role: the last message must be a user message "
            "(continuing an assistant message, prefill, is not supported)",
            param="messages",
        )
    calls: dict[str, int] = {}  # the tool_use ids of the assistant message before, by block index
    for i, message in enumerate(messages):
        blocks = message.blocks()
        if message.role == "assistant":
            for j, block in enumerate(blocks):
                if isinstance(block, ToolResultBlock):
                    raise APIError(400, f"messages[{i}].content[{j}]: tool_result blocks belong in a user message")
            calls = {block.id: j for j, block in enumerate(blocks) if isinstance(block, ToolUseBlock)}
            continue
        answered = set()
        text_seen = False
        for j, block in enumerate(blocks):
            where = f"messages[{i}].content[{j}]"
            if isinstance(block, ToolUseBlock):
                raise APIError(400, f"{where}: tool_use blocks belong in an assistant message", param="messages")
            if isinstance(block, TextBlock):
                text_seen = True
                continue
            if block.tool_use_id not in calls:
                raise APIError(
                    400,
                    f"{where}.tool_use_id: {block.tool_use_id!r} answers no tool_use block of the message before",
                    param="messages",
                )
            if block.tool_use_id in answered:
                raise APIError(400, f"{where}.tool_use_id: {block.tool_use_id!r} is answered twice", param="messages")
            if text_seen:
                raise APIError(400, f"{where}: tool_result blocks must come before text blocks", param="messages")
            answered.add(block.tool_use_id)
        unanswered = [call for call in calls if call not in answered]
        if unanswered:
            raise APIError(
                400,
                f"messages[{i}]: tool_use ids {unanswered} of the message before have no tool_result block here",
                param="messages",
            )
        calls = {}


def chat_request(request: CountTokensRequest, tier: str | None = None) -> ChatCompletionRequest:
    """The chat pipeline's request for `request` (a prompt rendered from it, with a generation prompt after)."""
    body = {
        "model": request.model,
        "messages": _chat_messages(request.system_blocks(), request.messages),
    }
    if request.tools:
        body["tools"] = [
            {
                "type": "function",
                "function": {"name": tool.name, "parameters": tool.input_schema}
                | ({} if tool.description is None else {"description": tool.description}),
            }
            for tool in request.tools
        ]
    choice = request.tool_choice
    if choice is not None:
        body["tool_choice"] = {
            "auto": "auto",
            "any": "required",
            "none": "none",
            "tool": {"type": "function", "function": {"name": choice.name}},
        }[choice.type]
        if choice.disable_parallel_tool_use:
            body["parallel_tool_calls"] = False
    if isinstance(request, MessagesRequest):
        body |= {
            "max_tokens": request.max_tokens,
            "stream": request.stream,
            "temperature": request.temperature,
            "top_p": request.top_p,
            "top_k": request.top_k,
            "stop": request.stop_sequences,
            "user": request.metadata and request.metadata.user_id,
            "service_tier": None if tier == BATCH_TIER else tier,
        }
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as error:  # what the Anthropic body allows, the chat body does: a server bug if not
        raise APIError(500, f"The request could not be converted: {error.errors()[0].get('msg')}") from error


def _chat_messages(system: list[TextBlock], messages: list[MessageParam]) -> list[dict]:
    turns = [{"role": "system", "content": "\n".join(block.text for block in system)}] if system else []
    for message in messages:
        blocks = message.blocks()
        text = "\n".join(block.text for block in blocks if isinstance(block, TextBlock))
        if message.role == "assistant":
            calls = [
                {
                    "id": block.id,
                    "type": "function",
                    "function": {"name": block.name, "arguments": json.dumps(block.input, ensure_ascii=False)},
                }
                for block in blocks
                if isinstance(block, ToolUseBlock)
            ]
            turns.append({"role": "assistant", "content": text or None} | ({"tool_calls": calls} if calls else {}))
            continue
        for block in blocks:
            if isinstance(block, ToolResultBlock):
                result = f"Error: {block.text}" if block.is_error else block.text
                turns.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": result})
        if text:
            turns.append({"role": "user", "content": text})
    return turns


def start_message(
    serving: Serving, request: MessagesRequest, principal: Principal, request_id: str | None = None
) -> tuple[Generation, MessageFormat]:
    """Checks, converts and starts `request` (the batch runner's `start` too: it sets service_tier "batch").
    `request_id`: its ledger row's (the client's x-request-id)."""
    chat = checked_chat_request(request)
    model = serving.model(chat.model)
    with _anthropic_names():
        breakpoints = cache_breakpoints(request, model, chat)
        gen, chat_format = serving.start_chat(chat, principal, request_id=request_id, cache_breakpoints=breakpoints)
    # Anthropic's contract: only a breakpoint writes. The engine still caches every prompt (a later hit reads at
    # 0.1x), but a prefix no breakpoint asked for, or one below the minimum length or past the pins' bound, is
    # billed as plain input, not as a write.
    gen.bills_automatic_writes = False
    return gen, MessageFormat(model.tokenizer, chat_format.tools, request.stop_sequences or [])


def checked_chat_request(request: MessagesRequest) -> ChatCompletionRequest:
    """`request` checked (what its types cannot say) and converted, at its tier."""
    check_conversation(request)
    marks(request)
    tier = requested_tier(request)
    chat = chat_request(request, tier)
    if tier == BATCH_TIER:  # no body may name it, so it is set past validation (as the OpenAI batch lines')
        chat = chat.model_copy(update={"service_tier": BATCH_TIER})
    return chat


def cache_breakpoints(
    request: CountTokensRequest, model: ModelServing, chat: ChatCompletionRequest
) -> tuple[CacheBreakpoint, ...]:
    """Each `cache_control` breakpoint as the number of prompt tokens it covers (see carpool.server.anthropic.
    caching): the renderings of the request cut after each marked block, against the full prompt's."""
    found = marks(request)
    if not found:
        return ()
    full = model.chat_prompt_ids(chat)
    return _for_the_door(
        [
            CacheBreakpoint(
                common_prefix_length(full, model.chat_prompt_ids(chat_request(cut(request, mark)), False)),
                mark.control.ttl_seconds,
            )
            for mark in found
        ]
    )


def _for_the_door(breakpoints: list[CacheBreakpoint]) -> tuple[CacheBreakpoint, ...]:
    """Ascending prefixes whose TTLs never grow, as the engine's door takes them. A template may put two marked
    blocks' ends at one token (Qwen renders the tools after the system text, so the last tool and the last system
    block both end the system turn), or in another order than Anthropic's: a prefix that a longer prefix pinned at
    least as long contains is pinned by that one already (its blocks are the longer prefix's first blocks)."""
    kept: list[CacheBreakpoint] = []
    for point in sorted(breakpoints, key=lambda point: (point.num_tokens, -point.ttl_seconds)):
        while kept and kept[-1].ttl_seconds <= point.ttl_seconds:
            kept.pop()
        if not kept or kept[-1].num_tokens < point.num_tokens:
            kept.append(point)
    return tuple(kept)


def count_tokens(serving: Serving, request: CountTokensRequest) -> dict:
    check_conversation(request)
    marks(request)
    chat = chat_request(request)
    with _anthropic_names():
        return {"input_tokens": len(serving.model(chat.model).chat_prompt_ids(chat))}


# The chat pipeline's names for the fields it checks, in the errors it raises, and the Messages API's.
_RENAMED = (
    (re.compile(r"\btools\[(\d+)\]\.function\.parameters"), r"tools[\1].input_schema"),
    (re.compile(r"^stop\b"), "stop_sequences"),
)


@contextmanager
def _anthropic_names():
    """The chat pipeline's 400s, with its field names as this API's (`stop` is `stop_sequences`)."""
    try:
        yield
    except APIError as error:
        message = error.message
        for pattern, name in _RENAMED:
            message = pattern.sub(name, message)
        error.message = message
        raise
