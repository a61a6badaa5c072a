"""Request bodies of OpenAI's Responses API (`POST /v1/responses`), as strict as the chat API's (carpool.server.
protocol): a field the body does not declare is a 400, and the API's features carpool does not serve (reasoning,
built-in tools, files, images, background runs...) are declared `Unsupported` or refused by item and part type,
each a 400 naming it, never ignored."""

from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Discriminator, Field, Tag
from pydantic_core import PydanticCustomError

from carpool.engine.tiers import LIVE_TIERS
from carpool.server.protocol import Body, NonEmpty, Text, Unsupported

MAX_METADATA_PAIRS = 16  # OpenAI's bounds on `metadata`
MAX_METADATA_KEY = 64
MAX_METADATA_VALUE = 512


def _served_types(what: str, served: tuple[str, ...], default: str | None = None):
    """A before-validator of a list of typed objects (input items, content parts, tools): a type this server does
    not serve is a 400 saying so (pydantic's own words would be "does not match any of the expected tags")."""

    def check(values: Any) -> Any:
        if isinstance(values, list):
            for i, value in enumerate(values):
                kind = value.get("type", default) if isinstance(value, dict) else None
                if isinstance(kind, str) and kind not in served:
                    raise PydanticCustomError(  # not "..._type": errors.py reads those as a wrong JSON type
                        "unsupported_kind",
                        "{what}[{index}] is of type {kind}, which this server does not support (it supports {served})",
                        {"what": what, "index": i, "kind": repr(kind), "served": ", ".join(map(repr, served))},
                    )
        return values

    return BeforeValidator(check)


class InputText(Body):
    type: Literal["input_text"]
    text: Text
    prompt_cache_breakpoint: Unsupported = None


class OutputText(Body):
    """An assistant message's text, as an earlier response gave it and a client sends it back."""

    type: Literal["output_text"]
    text: Text
    annotations: Unsupported = None
    logprobs: Unsupported = None


TextContent = Annotated[
    list[Annotated[InputText | OutputText, Discriminator("type")]],
    NonEmpty,
    _served_types("content", ("input_text", "output_text")),
]


class MessageItem(Body):
    """A message: OpenAI's EasyInputMessage (no `type`, content may be a string), an input message, or an
    assistant's output message sent back."""

    type: Literal["message"] | None = None
    role: Literal["user", "assistant", "system", "developer"]
    content: Text | TextContent
    id: Text | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None
    phase: Unsupported = None  # a reasoning model's label of its messages; carpool's output has none

    @property
    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class FunctionCallItem(Body):
    """A call the model made, sent back with its output."""

    type: Literal["function_call"]
    call_id: Text
    name: Text
    arguments: Text
    id: Text | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None
    namespace: Unsupported = None
    caller: Unsupported = None


class FunctionCallOutputItem(Body):
    type: Literal["function_call_output"]
    call_id: Text
    output: Text | Annotated[list[InputText], NonEmpty, _served_types("output", ("input_text",))]
    id: Text | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None
    caller: Unsupported = None

    @property
    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "".join(part.text for part in self.output)


def _item_type(item: Any) -> str:
    return (item.get("type") if isinstance(item, dict) else getattr(item, "type", None)) or "message"


Item = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")],
    Discriminator(_item_type),
]
ITEM_TYPES = ("message", "function_call", "function_call_output")


class FunctionTool(Body):
    type: Literal["function"]
    name: Annotated[str, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]
    description: Text | None = None
    parameters: dict | None = None
    strict: bool | None = None
    allowed_callers: Unsupported = None
    defer_loading: Unsupported = None
    output_schema: Unsupported = None


class FunctionChoice(Body):
    type: Literal["function"]
    name: Text


class TextFormat(Body):
    type: Literal["text", "json_object", "json_schema"]
    name: Text | None = Field(None, max_length=64, description="json_schema: the schema's name")
    schema_: dict | None = Field(None, alias="schema", description="json_schema: the schema")
    description: Text | None = None
    strict: bool | None = Field(None, description="always enforced: the output matches the schema by construction")


class TextConfig(Body):
    format: TextFormat | None = None
    verbosity: Unsupported = None


Metadata = Annotated[
    dict[Annotated[str, Field(max_length=MAX_METADATA_KEY)], Annotated[Text, Field(max_length=MAX_METADATA_VALUE)]],
    Field(max_length=MAX_METADATA_PAIRS),
]


class ResponsesRequest(Body):
    model: Text | None = None
    input: Text | Annotated[list[Item], NonEmpty, _served_types("input", ITEM_TYPES, "message")] | None = None
    instructions: Text | None = Field(None, description="a system message before the input (not carried over)")
    previous_response_id: Text | None = None
    store: bool | None = Field(None, description="keep the response for GET and previous_response_id (default true)")
    tools: Annotated[list[FunctionTool], Field(max_length=128), _served_types("tools", ("function",))] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    service_tier: Literal[("auto", *(tier.name for tier in LIVE_TIERS))] | None = None
    metadata: Metadata | None = None
    user: Text | None = None
    stream: bool | None = None
    truncation: Literal["disabled"] | None = Field(None, description="a prompt past the context is a 400")
    # OpenAI parameters carpool does not implement.
    reasoning: Unsupported = None
    include: Unsupported = None
    background: Unsupported = None
    conversation: Unsupported = None
    prompt: Unsupported = None
    max_tool_calls: Unsupported = None
    top_logprobs: Unsupported = None
    stream_options: Unsupported = None
    context_management: Unsupported = None
    prompt_cache_key: Unsupported = None
    prompt_cache_retention: Unsupported = None
    prompt_cache_options: Unsupported = None
    safety_identifier: Unsupported = None
    moderation: Unsupported = None
    image: Unsupported = None
    access_programs: Unsupported = None
