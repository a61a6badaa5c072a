"""A Responses request as the chat pipeline's own request, and the chat pipeline's output as Responses output: one
path through tools, tool grammars, the engine's door, the tier queues, the gate and the ledger for both APIs.

Input items become chat messages: consecutive `function_call` items one assistant turn's `tool_calls` (added to
the assistant message just before them, if any), a `function_call_output` a `tool` message, `instructions` a
system message first (an earlier response's instructions are not carried over, as OpenAI documents).
"""

import re

from pydantic import TypeAdapter, ValidationError

from carpool.server.errors import APIError, field_path
from carpool.server.generation import Generation
from carpool.server.protocol import ChatCompletionRequest
from carpool.server.responses_api.protocol import (
    FunctionCallItem,
    FunctionCallOutputItem,
    Item,
    MessageItem,
    ResponsesRequest,
)

ITEMS = TypeAdapter(list[Item])
# The chat request's names, in a chat-pipeline error, as the Responses request calls them.
_RENAMED = (
    (re.compile(r"^messages\b"), "input"),
    (re.compile(r"\bmax_(completion_)?tokens\b"), "max_output_tokens"),
    (re.compile(r"\bresponse_format(\.json_schema)?\b"), "text.format"),
    (re.compile(r"^tools\[(\d+)\]\.function\b"), r"tools[\1]"),
)
_PARAMS = {"messages": "input", "max_completion_tokens": "max_output_tokens", "response_format": "text"}


def input_items(body: ResponsesRequest) -> list[Item]:
    if body.input is None:
        return []
    return [MessageItem(role="user", content=body.input)] if isinstance(body.input, str) else body.input


# Item id prefixes by type, as OpenAI's own ids start.
_ID_PREFIXES = {"message": "msg", "function_call": "fc", "function_call_output": "fco"}


def listed_item(item: dict, response_id: str, index: int) -> dict:
    """A stored input item as `input_items` lists it: typed, with an id (its own, else one made from the response's
    and its place, so the same item has the same id on every call), content as a list of parts, completed."""
    kind = item.get("type", "message")
    listed = {"id": f"{_ID_PREFIXES[kind]}_{response_id.removeprefix('resp_')}_{index}"} | item
    listed |= {"type": kind, "status": item.get("status") or "completed"}
    if kind == "message" and isinstance(item["content"], str):
        part = "output_text" if item["role"] == "assistant" else "input_text"
        listed["content"] = [
            {"type": part, "text": item["content"]} | ({"annotations": []} if part == "output_text" else {})
        ]
    return listed


def chat_request(body: ResponsesRequest, context: list[Item]) -> ChatCompletionRequest:
    """The chat request that answers `body` after `context` (its input items, earlier turns included)."""
    system = [{"role": "system", "content": body.instructions}] if body.instructions is not None else []
    chat = {
        "model": body.model,
        "messages": system + _messages(context),
        "max_completion_tokens": body.max_output_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "service_tier": body.service_tier,
        "user": body.user,
        "stream": body.stream,
        "tools": None if body.tools is None else [_chat_tool(tool) for tool in body.tools],
        "tool_choice": body.tool_choice if isinstance(body.tool_choice, str | None) else _named(body.tool_choice),
        "parallel_tool_calls": body.parallel_tool_calls,
        "response_format": _response_format(body),
    }
    try:
        return ChatCompletionRequest.model_validate({key: value for key, value in chat.items() if value is not None})
    except ValidationError as error:  # what the chat API refuses beyond this API's own validation (an empty input)
        first = error.errors()[0]
        message = f"{field_path(list(first['loc']))}: {first['msg']}"
        raise renamed(APIError(400, message, str(first["loc"][0]))) from error


def renamed(error: APIError) -> APIError:
    """A chat-pipeline error naming the Responses request's fields."""
    message = error.message
    for pattern, name in _RENAMED:
        message = pattern.sub(name, message)
    param = _PARAMS.get(error.param, error.param)
    return APIError(error.status, message, param, error.code, error.retry_after)


def _messages(items: list[Item]) -> list[dict]:
    messages: list[dict] = []
    for item in items:
        if isinstance(item, MessageItem):
            messages.append({"role": item.role, "content": item.text})
        elif isinstance(item, FunctionCallItem):
            call = {
                "id": item.call_id,
                "type": "function",
                "function": {"name": item.name, "arguments": item.arguments},
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif isinstance(item, FunctionCallOutputItem):
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text})
    return messages


def _chat_tool(tool) -> dict:
    function = {
        "name": tool.name,
        "description": tool.description,
        "parameters": tool.parameters,
        "strict": tool.strict,
    }
    return {"type": "function", "function": {key: value for key, value in function.items() if value is not None}}


def _named(choice) -> dict:
    return {"type": "function", "function": {"name": choice.name}}


def _response_format(body: ResponsesRequest) -> dict | None:
    spec = body.text and body.text.format
    if spec is None or spec.type != "json_schema":
        return None if spec is None else {"type": spec.type}
    for name in ("name", "schema_"):
        if getattr(spec, name) is None:
            field = name.rstrip("_")
            raise APIError(400, f"text.format.{field}: required when type is 'json_schema'", param="text")
    schema = {"name": spec.name, "schema": spec.schema_, "description": spec.description, "strict": spec.strict}
    return {"type": "json_schema", "json_schema": {key: value for key, value in schema.items() if value is not None}}


# Output -------------------------------------------------------------------------------------------------------


def response_id(gen: Generation) -> str:
    """The response's id: the generation's (and so its ledger row's) hex, under the Responses API's prefix."""
    return "resp_" + gen.request_id.partition("-")[2]


def message_item(item_id: str, text: str, status: str) -> dict:
    content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
    return {"id": item_id, "type": "message", "role": "assistant", "status": status, "content": content}


def call_item(item_id: str, call: dict, status: str = "completed") -> dict:
    function = call["function"]
    return {
        "id": item_id,
        "type": "function_call",
        "call_id": call["id"],
        "name": function["name"],
        "arguments": function["arguments"],
        "status": status,
    }


def output_items(gen: Generation, choice: dict) -> list[dict]:
    """A whole chat choice (ChatFormat's) as output items: its text, then its calls."""
    message, status = choice["message"], finished_status(choice["finish_reason"])
    items = [message_item(item_id(gen, "msg", 0), message["content"], status)] if message["content"] else []
    for call in message.get("tool_calls") or []:
        items.append(call_item(item_id(gen, "fc", len(items)), call))
    return items


def item_id(gen: Generation, prefix: str, index: int) -> str:
    """An output item's id: its response's hex and its place in the output."""
    return f"{prefix}_{gen.request_id.partition('-')[2]}_{index}"


def usage(gen: Generation) -> dict:
    return {
        "input_tokens": gen.prompt_tokens,
        "input_tokens_details": {"cached_tokens": gen.cached_tokens, "cache_write_tokens": gen.cache_write_tokens},
        "output_tokens": gen.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": gen.prompt_tokens + gen.completion_tokens,
    }


def response_body(
    body: ResponsesRequest,
    gen: Generation,
    status: str,
    output: list[dict],
    finished_at: int | None = None,
    error: dict | None = None,
) -> dict:
    """The response object: `status` in_progress (no usage yet), completed, incomplete or failed."""
    return {
        "id": response_id(gen),
        "object": "response",
        "created_at": gen.created,
        "completed_at": finished_at if status == "completed" else None,
        "status": status,
        "error": error,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "background": False,
        "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens,
        "max_tool_calls": None,
        "metadata": body.metadata or {},
        "model": gen.model_name,
        "output": output,
        "parallel_tool_calls": body.parallel_tool_calls is not False,
        "previous_response_id": body.previous_response_id,
        "reasoning": None,
        "service_tier": gen.tier,
        "store": body.store is not False,
        "temperature": 1.0 if body.temperature is None else body.temperature,
        "text": {"format": {"type": "text"}} if body.text is None or body.text.format is None else _text(body),
        "tool_choice": _tool_choice(body),
        "tools": [tool.model_dump(exclude_none=True) for tool in body.tools or []],
        "top_p": 1.0 if body.top_p is None else body.top_p,
        "truncation": "disabled",
        "usage": None if status == "in_progress" else usage(gen),
        "user": body.user,
    }


def _text(body: ResponsesRequest) -> dict:
    return {"format": body.text.format.model_dump(exclude_none=True, by_alias=True)}


def _tool_choice(body: ResponsesRequest):
    choice = body.tool_choice
    return "auto" if choice is None else choice if isinstance(choice, str) else choice.model_dump()


def finished_status(finish_reason: str | None) -> str:
    """A response's (and its last item's) status: max_output_tokens cut it, or it completed."""
    return "incomplete" if finish_reason == "length" else "completed"
