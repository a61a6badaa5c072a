"""Request bodies of Anthropic's Messages API, as strict as the OpenAI routes' (carpool.server.protocol): a wrong
type or a field this server does not know is a 400 naming it, never coerced or ignored.

Content the served models cannot take (images, documents, PDFs, thinking, server tools' blocks) parses as a
known block type so that the 400 can name the block (`messages[0].content[1]: image blocks are not supported`),
rather than saying only that the type is not one of the expected tags.
"""

import json
import re
from typing import Annotated, Literal

from fastapi import Request
from pydantic import Field, ValidationError, field_validator, model_validator
from pydantic_core import PydanticCustomError

from carpool.engine.tiers import LIVE_TIERS
from carpool.server.errors import APIError
from carpool.server.protocol import MAX_STOP_STRINGS, Body, NonEmpty, Text

_TYPE_NAMES = {"str", "int", "float", "bool", "none", "dict"}
MAX_TOOLS = 128  # as the OpenAI route's `tools`
MAX_USER_ID = 256
# Block types of Anthropic's API that carry what a text-only model cannot read or this server does not run.
UNSUPPORTED_BLOCKS = (
    "image",
    "document",
    "search_result",
    "thinking",
    "redacted_thinking",
    "server_tool_use",
    "web_search_tool_result",
    "web_fetch_tool_result",
    "code_execution_tool_result",
    "bash_code_execution_tool_result",
    "text_editor_code_execution_tool_result",
    "mcp_tool_use",
    "mcp_tool_result",
    "container_upload",
)
# Anthropic's own names, then carpool's live tiers as an extension (see convert.requested_tier).
SERVICE_TIERS = ("auto", "standard_only", *(tier.name for tier in LIVE_TIERS))


class CacheControl(Body):
    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = Field(None, description='how long the prefix stays cached (default "5m")')

    @property
    def ttl_seconds(self) -> float:
        return 3600.0 if self.ttl == "1h" else 300.0


class TextBlock(Body):
    type: Literal["text"]
    text: Annotated[Text, Field(min_length=1)]
    cache_control: CacheControl | None = None
    citations: None = Field(None, description="not supported: omit it, or null")


class ToolUseBlock(Body):
    """A call the assistant made, sent back with the conversation."""

    type: Literal["tool_use"]
    id: Annotated[Text, Field(min_length=1)]
    name: Annotated[Text, Field(min_length=1)]
    input: dict
    cache_control: CacheControl | None = None


class ToolResultText(Body):
    type: Literal["text"]
    text: Text


class ToolResultBlock(Body):
    type: Literal["tool_result"]
    tool_use_id: Annotated[Text, Field(min_length=1)]
    content: Text | list[ToolResultText] | None = None
    is_error: bool | None = None
    cache_control: CacheControl | None = None

    @property
    def text(self) -> str:
        if isinstance(self.content, list):
            return "\n".join(part.text for part in self.content)
        return self.content or ""


class UnsupportedBlock(Body):
    """Parsed only to be refused by name."""

    model_config = Body.model_config | {"extra": "allow"}
    type: Literal[UNSUPPORTED_BLOCKS]

    @model_validator(mode="after")
    def _refuse(self):
        raise PydanticCustomError(
            "unsupported_block",
            "{kind} blocks are not supported by this server (its models take text, tool_use and tool_result)",
            {"kind": self.type},
        )


ContentBlock = Annotated[TextBlock | ToolUseBlock | ToolResultBlock | UnsupportedBlock, Field(discriminator="type")]
CacheableBlock = TextBlock | ToolUseBlock | ToolResultBlock


class MessageParam(Body):
    role: Literal["user", "assistant"]
    content: Annotated[Text, Field(min_length=1)] | Annotated[list[ContentBlock], NonEmpty]

    def blocks(self) -> list[CacheableBlock]:
        """The content as blocks (a string is one text block)."""
        return [TextBlock(type="text", text=self.content)] if isinstance(self.content, str) else self.content


class ToolParam(Body):
    """A client tool. Anthropic's server tools (web search, code execution, ...) have a versioned `type`."""

    type: Text | None = None
    name: Annotated[str, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]
    description: Text | None = None
    input_schema: dict
    cache_control: CacheControl | None = None

    @field_validator("type")
    @classmethod
    def _client_tool(cls, kind: str | None) -> str | None:
        if kind not in (None, "custom"):
            raise PydanticCustomError(
                "unsupported_tool", "server tools ({kind}) are not supported by this server", {"kind": kind}
            )
        return kind


class ToolChoice(Body):
    type: Literal["auto", "any", "tool", "none"]
    name: Text | None = Field(None, description='the tool to call, with type "tool"')
    disable_parallel_tool_use: bool | None = None

    @model_validator(mode="after")
    def _name_with_tool(self):
        if (self.type == "tool") != (self.name is not None):
            raise PydanticCustomError("tool_choice_name", 'name is required with type "tool", and only with it')
        return self


class Metadata(Body):
    user_id: Annotated[Text, Field(max_length=MAX_USER_ID)] | None = None


class ThinkingConfig(Body):
    type: Literal["enabled", "disabled"]
    budget_tokens: int | None = None

    @model_validator(mode="after")
    def _disabled_only(self):
        if self.type != "disabled":
            raise PydanticCustomError("unsupported_parameter", "extended thinking is not supported by this server")
        return self


class CountTokensRequest(Body):
    """POST /v1/messages/count_tokens: what the prompt would be, without max_tokens or sampling."""

    model: Text
    messages: Annotated[list[MessageParam], NonEmpty]
    system: Annotated[Text, Field(min_length=1)] | Annotated[list[TextBlock], NonEmpty] | None = None
    tools: Annotated[list[ToolParam], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: ToolChoice | None = None
    cache_control: CacheControl | None = Field(None, description="one breakpoint on the last cacheable block")
    thinking: ThinkingConfig | None = None

    @field_validator("tools")
    @classmethod
    def _unique_names(cls, tools: list[ToolParam] | None) -> list[ToolParam] | None:
        """A tool_use block names its tool, so two tools of one name could not be told apart (Anthropic refuses
        them too; before, the chat request they became refused them, a 500)."""
        first: dict[str, int] = {}
        for i, tool in enumerate(tools or ()):
            if first.setdefault(tool.name, i) != i:
                raise PydanticCustomError(
                    "duplicate_tool_name",
                    "tool names must be unique: '{name}' is the name of tools[{first}] and tools[{i}]",
                    {"name": tool.name, "first": first[tool.name], "i": i},
                )
        return tools

    def system_blocks(self) -> list[TextBlock]:
        if isinstance(self.system, str):
            return [TextBlock(type="text", text=self.system)]
        return self.system or []


class MessagesRequest(CountTokensRequest):
    """POST /v1/messages."""

    max_tokens: int = Field(ge=1)
    stop_sequences: Annotated[list[Annotated[Text, Field(min_length=1)]], Field(max_length=MAX_STOP_STRINGS)] | None = (
        None
    )
    temperature: float | None = Field(None, ge=0, le=1)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0, description="0: no limit")
    stream: bool | None = None
    metadata: Metadata | None = None
    service_tier: Literal[SERVICE_TIERS] | None = Field(
        None, description='"auto" and "standard_only": the default tier; carpool\'s priority, default, flex by name'
    )
    # Anthropic parameters carpool does not implement: only null is taken.
    container: None = None
    mcp_servers: None = None
    context_management: None = None


class MessageBatchRequest(Body):
    custom_id: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    params: MessagesRequest


class CreateMessageBatch(Body):
    """POST /v1/messages/batches, as /openapi.json documents it: the route checks each request itself (batches.py),
    to name `requests[i].params...` in its 400s."""

    requests: Annotated[list[MessageBatchRequest], NonEmpty]


async def json_body(request: Request):
    """The body as JSON, or a 400 saying why it is not."""
    raw = await request.body()
    try:
        return json.loads(raw)
    except (UnicodeDecodeError, ValueError) as error:
        raise APIError(400, f"The request body is not valid JSON: {error}") from None


def parse(model: type[Body], data, prefix: str = ""):
    """`data` (parsed JSON) as `model`, or a 400 naming the first bad field (`messages[0].content[1].text`, after
    `prefix`, e.g. `requests[3].params.`)."""
    try:
        return model.model_validate(data)
    except ValidationError as error:
        first = _most_telling(error.errors())
        path = prefix + _field_path(first.get("loc", ()))
        if first.get("type") == "extra_forbidden":
            message = f"{path}: unknown field (not part of the Messages API, or not supported by this server)"
        else:
            message = f"{path}: {first.get('msg')}" if path else f"The request body: {first.get('msg')}"
        raise APIError(400, message, param=path.split(".")[0].split("[")[0] or None) from None


def _most_telling(errors: list[dict]) -> dict:
    """A value that fits none of a field's types gets an error per type: a content list with a bad block says
    "Input should be a valid string" first. The deepest error that is not about a type names the real fault."""
    telling = [error for error in errors if not error.get("type", "").endswith("_type")] or errors
    return max(telling, key=lambda error: len(error.get("loc", ())))


def _field_path(loc) -> str:
    """pydantic's error location as a path, without the union members it tried (`str`, `list[...]`) or the tag a
    block's type chose (`tool_use`), which pydantic puts right after the index of a tagged union's item."""
    path, tag_next = "", False
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
            continue
        if tag_next:
            tag_next = False
            continue
        if "tagged-union" in part:
            tag_next = True
        elif re.fullmatch(r"[a-z_]+", part) and part not in _TYPE_NAMES:
            path += f".{part}" if path else part
    return path
