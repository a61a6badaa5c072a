"""`cache_control` breakpoints: where a request marks them, Anthropic's rules on them, and each one as a count of
prompt tokens (a CacheBreakpoint for the engine's door).

A breakpoint on a block caches the prompt up to and including that block, in the order tools, system, messages.
At most MAX_CACHE_BREAKPOINTS (4) per request (a top-level `cache_control`, which marks the last block of the last
message, counts as one), and a 1-hour breakpoint may not come after a 5-minute one. Both are 400s naming the block.

The chat template renders the conversation as a whole (Qwen's puts the tools inside the system turn, after the
system text), so a block's end has no place in the prompt's text until rendered: the request is rendered again cut
after the marked block (for a tool: later tools and every message dropped; for a system block: later system
blocks and every message; for a message block: every later block and message; no generation prompt), and the
breakpoint is the length of the common token prefix of that rendering and the full prompt's.
A cut's rendering differs from the full prompt only after the block, so the common prefix ends at the block's end
(or a token short of it, where a token spans the block's end and what follows it in the full prompt).
"""

from dataclasses import dataclass
from itertools import pairwise

from carpool.engine.request import MAX_CACHE_BREAKPOINTS
from carpool.server.anthropic.protocol import CacheControl, CountTokensRequest, MessageParam, TextBlock, ToolChoice
from carpool.server.errors import APIError

# A user turn no message starts like: its text is a control character no client writes first.
_SENTINEL = MessageParam.model_construct(
    role="user", content=[TextBlock.model_construct(type="text", text="\x00", cache_control=None)]
)


@dataclass(frozen=True)
class Mark:
    """A marked block: `where` names it in the request (`tools[2]`, `system[0]`, `messages[3].content[1]`)."""

    where: str
    control: CacheControl
    tool: int | None = None
    system: int | None = None
    message: int | None = None
    block: int | None = None


def marks(request: CountTokensRequest) -> list[Mark]:
    """The request's breakpoints in prompt order, checked against Anthropic's rules (400 naming the block)."""
    found = [
        Mark(f"tools[{i}]", tool.cache_control, tool=i)
        for i, tool in enumerate(request.tools or [])
        if tool.cache_control is not None
    ]
    if isinstance(request.system, list):
        found += [
            Mark(f"system[{j}]", block.cache_control, system=j)
            for j, block in enumerate(request.system)
            if block.cache_control is not None
        ]
    for k, message in enumerate(request.messages):
        if isinstance(message.content, list):
            found += [
                Mark(f"messages[{k}].content[{b}]", block.cache_control, message=k, block=b)
                for b, block in enumerate(message.content)
                if block.cache_control is not None
            ]
    if request.cache_control is not None:
        k = len(request.messages) - 1
        b = len(request.messages[k].blocks()) - 1
        last = Mark(f"messages[{k}].content[{b}]", request.cache_control, message=k, block=b)
        explicit = next((mark for mark in found if mark.where == last.where), None)
        if explicit is None:
            found.append(last)
        elif explicit.control.ttl_seconds != last.control.ttl_seconds:
            raise APIError(
                400,
                f"cache_control: the last block ({last.where}) has a cache_control of another ttl already",
                param="cache_control",
            )
    if len(found) > MAX_CACHE_BREAKPOINTS:
        raise APIError(
            400,
            f"{found[MAX_CACHE_BREAKPOINTS].where}.cache_control: at most {MAX_CACHE_BREAKPOINTS} blocks may have "
            f"cache_control (a top-level cache_control counts as one), got {len(found)}",
            param="cache_control",
        )
    for before, after in pairwise(found):
        if after.control.ttl_seconds > before.control.ttl_seconds:
            raise APIError(
                400,
                f"{after.where}.cache_control: a ttl of {after.control.ttl!r} may not come after a shorter one "
                f"({before.where} has {before.control.ttl or '5m'!r}): longer TTLs come first",
                param="cache_control",
            )
    return found


def cut(request: CountTokensRequest, mark: Mark) -> CountTokensRequest:
    """The request with everything after the marked block dropped (later tools, system blocks or messages)."""
    if mark.tool is not None:
        choice = request.tool_choice
        # A named tool may be one of those dropped; the tools render the same whatever the choice (but "none").
        if choice is not None and choice.type != "none":
            choice = ToolChoice(type="auto")
        # No messages; but a template needs some turn, and with no system a user turn that differs from the
        # first message at its first character (the common prefix then takes in that turn's header too: the
        # tokens every conversation with these tools starts its first message with).
        messages = [] if request.system else [_SENTINEL]
        update = {"tools": request.tools[: mark.tool + 1], "tool_choice": choice, "messages": messages}
        return request.model_copy(update=update)
    if mark.system is not None:
        return request.model_copy(update={"system": request.system[: mark.system + 1], "messages": []})
    message = request.messages[mark.message]
    if isinstance(message.content, list):
        message = message.model_copy(update={"content": message.content[: mark.block + 1]})
    return request.model_copy(update={"messages": [*request.messages[: mark.message], message]})


def common_prefix_length(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
