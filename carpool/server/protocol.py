"""Request bodies of the OpenAI-compatible API. Validation is strict, so a wrong type is a 400 rather than
silently coerced ("3" is not 3). Every optional field also takes null, which some clients send for "not set".

No parameter is silently ignored. A field the body does not declare is a 400 ("Unrecognized request argument
supplied", as OpenAI answers). OpenAI parameters carpool does not implement are declared `Unsupported`: accepted
only with a value that asks for nothing (null, false, [], "none", {"type": "text"}), else a 400 naming them.
Extensions are vLLM's, with vLLM's names and meanings. Text must be valid Unicode: a lone UTF-16 surrogate
("\\ud800" in the JSON) is a 400 naming the field, found in the same validation pass as every other error.
"""

import json
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator
from pydantic_core import PydanticCustomError

from carpool.engine.sampling_params import MAX_LOGIT_BIAS, MAX_LOGPROBS, MAX_PENALTY
from carpool.engine.structured import StructuredOutput
from carpool.engine.structured.spec import MAX_CHOICE_STRINGS
from carpool.engine.tiers import LIVE_TIERS

MAX_CHOICES = 128  # n (or best_of) times the number of prompts
MAX_STOP_STRINGS = 4
# Each entry costs a little Python on every step of its request: bounded as OpenAI bounds logit_bias.
MAX_LOGIT_BIAS_ENTRIES = 1024
MAX_BAD_WORDS = 256

NonEmpty = Field(min_length=1)
_NEUTRAL = (None, False, "", "none", [], {}, ["text"], {"type": "text"})


def _valid_unicode(text: str) -> str:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise PydanticCustomError(
            "invalid_unicode",
            "contains a lone UTF-16 surrogate ({char}) at character {index}, which is not text",
            {"char": ascii(text[error.start]), "index": error.start},
        ) from None
    return text


def _one_of(*fields: str) -> list[dict]:
    """ "Exactly one of these fields", as /openapi.json says it: one not null, the others left out or null."""
    return [
        {
            "required": [field],
            "properties": {field: {"not": {"type": "null"}}} | {o: {"type": "null"} for o in fields if o != field},
        }
        for field in fields
    ]


def _nothing_asked(value: Any) -> Any:
    if not any(value == neutral and type(value) is type(neutral) for neutral in _NEUTRAL):
        raise PydanticCustomError("unsupported_parameter", "not supported by this server (omit it, or send null)")
    return None


Text = Annotated[str, AfterValidator(_valid_unicode)]
Choices = Annotated[list[Annotated[Text, Field(min_length=1)]], Field(min_length=1, max_length=MAX_CHOICE_STRINGS)]
Unsupported = Annotated[
    Any,
    AfterValidator(_nothing_asked),
    Field(description="Not supported: omit it, or null", json_schema_extra={"enum": list(_NEUTRAL)}),
]


class Body(BaseModel):
    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="forbid")


class StreamOptions(Body):
    include_usage: bool | None = None
    include_obfuscation: Unsupported = None


class TextPart(Body):
    type: Literal["text"]
    text: Text


class FunctionCall(Body):
    name: Text
    arguments: Text  # a JSON object, as text


class ToolCall(Body):
    id: Text
    type: Literal["function"]
    function: FunctionCall


class ChatMessage(Body):
    # Only an assistant turn may leave content out or null, as /openapi.json says it (in an allOf, beside the
    # object's own keywords, which tools reading only `type` and `properties` still find).
    model_config = ConfigDict(
        json_schema_extra={
            "allOf": [
                {
                    "anyOf": [
                        {"properties": {"role": {"const": "assistant"}}},
                        {"required": ["content"], "properties": {"content": {"type": ["string", "array"]}}},
                    ]
                }
            ]
        }
    )
    role: Literal["system", "developer", "user", "assistant", "tool"]
    # Checked when left out too: only an assistant turn (its calls, sent back) may come without content.
    content: Text | Annotated[list[TextPart], NonEmpty] | None = Field(None, validate_default=True)
    name: Text | None = Field(None, description="passed to the chat template, which may use it")
    # What an assistant turn of an earlier response carries when a client sends the conversation back.
    refusal: Unsupported = None
    annotations: Unsupported = None
    audio: Unsupported = None
    tool_calls: list[ToolCall] | None = None  # an assistant turn's calls, sent back with their results
    tool_call_id: Text | None = None  # the call a `tool` message answers
    function_call: Unsupported = None

    @field_validator("content")
    @classmethod
    def _content_unless_assistant(cls, content, info: ValidationInfo):
        if content is None and info.data.get("role", "assistant") != "assistant":  # OpenAI's words for it
            raise PydanticCustomError("null_content", "Invalid value for 'content': expected a string, got null.")
        return content

    @property
    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class JsonSchema(Body):
    name: Text = Field(max_length=64)
    description: Text | None = None
    schema_: dict | None = Field(None, alias="schema")
    strict: bool | None = Field(None, description="always enforced: the output matches the schema by construction")


class ResponseFormat(Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchema | None = None


class StructuredOutputs(Body):
    """vLLM's `structured_outputs`: exactly one of these."""

    json_: dict | Text | None = Field(None, alias="json")
    regex: Text | None = None
    choice: Choices | None = None
    grammar: Text | None = None
    json_object: bool | None = None


class FunctionDefinition(Body):
    name: Annotated[str, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]
    description: Text | None = None
    parameters: dict | None = None
    strict: bool | None = None


class Tool(Body):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(Body):
    name: Text


class NamedToolChoice(Body):
    type: Literal["function"]
    function: FunctionName


class PromptCompression(Body):
    """carpool's extension: compress the prompt before prefill (LLMLingua, scored by a small served model).
    The system prompt, the final question (the last paragraph of the last message or prompt) and `protected`
    spans are kept verbatim."""

    model_config = ConfigDict(json_schema_extra={"allOf": [{"anyOf": _one_of("rate", "target_tokens")}]})
    rate: float | None = Field(None, gt=0, le=1, description="the share of the prompt's tokens to keep")
    target_tokens: int | None = Field(None, ge=1, description="how many prompt tokens to keep")
    protected: Annotated[list[Text], Field(max_length=64)] | None = Field(None, description="spans kept verbatim")

    @model_validator(mode="after")
    def _one_budget(self):
        if (self.rate is None) == (self.target_tokens is None):
            raise PydanticCustomError("compression_budget", "give exactly one of rate and target_tokens")
        return self


class GenerationRequest(Body):
    """What chat and text completions share."""

    model: Text | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    n: int | None = Field(None, ge=1, le=MAX_CHOICES)
    stop: Text | Annotated[list[Text], Field(max_length=MAX_STOP_STRINGS)] | None = None
    seed: int | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    user: Text | None = None
    cache_salt: Text | None = Field(
        None, max_length=256, description="prefix-cache tenant; default: the API key, else user"
    )
    service_tier: Literal[("auto", *(tier.name for tier in LIVE_TIERS))] | None = None
    presence_penalty: float | None = Field(None, ge=-MAX_PENALTY, le=MAX_PENALTY)
    frequency_penalty: float | None = Field(None, ge=-MAX_PENALTY, le=MAX_PENALTY)
    logit_bias: (
        Annotated[
            dict[Text, Annotated[float, Field(ge=-MAX_LOGIT_BIAS, le=MAX_LOGIT_BIAS)]],
            Field(max_length=MAX_LOGIT_BIAS_ENTRIES),
        ]
        | None
    ) = Field(None, description="token id (as a string) -> bias added to its logit")
    # Extensions, with vLLM's names and meanings.
    top_k: int | None = Field(None, ge=-1, description="-1 or 0: no limit")
    min_p: float | None = Field(None, ge=0, le=1)
    priority: int | None = Field(
        None,
        ge=0,
        le=len(LIVE_TIERS) - 1,
        description="the tier by number: " + ", ".join(f"{tier.priority} {tier.name}" for tier in LIVE_TIERS),
    )
    ignore_eos: bool | None = None
    repetition_penalty: float | None = Field(
        None, gt=0, description="over prompt and output tokens: positive logits divided by it, negative multiplied"
    )
    min_tokens: int | None = Field(None, ge=0, description="EOS, stop_token_ids and stop strings wait for this many")
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    bad_words: Annotated[list[Text], Field(max_length=MAX_BAD_WORDS)] | None = Field(
        None, description="never complete one of these words (as tokenized alone or after a space)"
    )
    speculative: bool | None = Field(
        None,
        description="false: no speculative decoding for this request "
        "(default: the server's --speculative-model, if any)",
    )
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict | Text | None = None
    guided_regex: Text | None = None
    guided_choice: Choices | None = None
    guided_grammar: Text | None = Field(None, description="Lark, or llama.cpp's GBNF")
    prompt_compression: PromptCompression | None = None
    # OpenAI parameters carpool does not implement.
    store: Unsupported = None
    metadata: Unsupported = None
    prompt_cache_key: Unsupported = None
    safety_identifier: Unsupported = None

    @field_validator("stream_options")
    @classmethod
    def _only_when_streaming(cls, options: StreamOptions | None, info: ValidationInfo) -> StreamOptions | None:
        if options is not None and not info.data.get("stream"):  # OpenAI's words for it
            raise PydanticCustomError(
                "stream_options_without_stream",
                "The 'stream_options' parameter is only allowed when 'stream' is enabled.",
            )
        return options

    @field_validator("logit_bias")
    @classmethod
    def _token_ids(cls, bias: dict[str, float] | None) -> dict[str, float] | None:
        bad = [key for key in bias or () if not key.isascii() or not key.isdecimal()]
        if bad:
            raise PydanticCustomError(
                "token_id", "keys must be token ids (decimal integers), got {keys}", {"keys": ascii(bad[:5])}
            )
        return bias

    def structured_output(self) -> StructuredOutput | None:
        """The one constraint the body asks for; ValueError naming the field if it asks for several or a bad one."""
        asked = [
            (name, getattr(self, name))
            for name in (
                "response_format",
                "structured_outputs",
                "guided_json",
                "guided_regex",
                "guided_choice",
                "guided_grammar",
            )
            if getattr(self, name, None) is not None
        ]
        specs = [spec for name, value in asked if (spec := _structured(name, value)) is not None]
        if len(specs) > 1:
            raise ValueError(
                f"{specs[1].source}: only one of response_format, structured_outputs and guided_* may "
                f"be given, got also {specs[0].source}"
            )
        return specs[0] if specs else None

    def sampling_options(self) -> dict:
        """The SamplingParams fields the body sets as they are (max_tokens, seed, logprobs and best_of depend
        on the endpoint and on the choice)."""
        return {
            "temperature": 1.0 if self.temperature is None else self.temperature,
            "top_p": 1.0 if self.top_p is None else self.top_p,
            "top_k": max(0, self.top_k or 0),
            "min_p": self.min_p or 0.0,
            "stop": self.stop,
            "ignore_eos": bool(self.ignore_eos),
            "presence_penalty": self.presence_penalty or 0.0,
            "frequency_penalty": self.frequency_penalty or 0.0,
            "repetition_penalty": 1.0 if self.repetition_penalty is None else self.repetition_penalty,
            "logit_bias": {int(token): bias for token, bias in self.logit_bias.items()} if self.logit_bias else None,
            "min_tokens": self.min_tokens or 0,
            "stop_token_ids": self.stop_token_ids,
            "bad_words": self.bad_words,
            "speculative": self.speculative is not False,
        }


class ChatCompletionRequest(GenerationRequest):
    messages: Annotated[list[ChatMessage], NonEmpty]
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    response_format: ResponseFormat | None = None
    tools: Annotated[list[Tool], Field(max_length=128)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # OpenAI parameters carpool does not implement.
    functions: Unsupported = None
    function_call: Unsupported = None
    modalities: Unsupported = None
    audio: Unsupported = None
    prediction: Unsupported = None
    reasoning_effort: Unsupported = None
    verbosity: Unsupported = None
    web_search_options: Unsupported = None
    prompt_cache_retention: Unsupported = None

    @field_validator("tools")
    @classmethod
    def _unique_names(cls, tools: list[Tool] | None) -> list[Tool] | None:
        """A call names its function, so two tools of one name could not be told apart (OpenAI refuses them too);
        the call grammar also keeps each function's parameters under its name."""
        first: dict[str, int] = {}
        for i, tool in enumerate(tools or ()):
            if first.setdefault(tool.function.name, i) != i:
                raise PydanticCustomError(
                    "duplicate_tool_name",
                    "function names must be unique: '{name}' is the name of tools[{first}] and tools[{i}]",
                    {"name": tool.function.name, "first": first[tool.function.name], "i": i},
                )
        return tools


class CompletionRequest(GenerationRequest):
    prompt: (
        Annotated[Text, NonEmpty]
        | Annotated[list[Annotated[Text, NonEmpty]], NonEmpty]
        | Annotated[list[int], NonEmpty]
        | Annotated[list[Annotated[list[int], NonEmpty]], NonEmpty]
    )
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool | None = Field(None, description="the prompt's text before each choice's text")
    best_of: int | None = Field(
        None,
        ge=1,
        le=MAX_CHOICES,
        description="candidates per prompt; the n with the highest cumulative logprob return",
    )
    prompt_logprobs: int | None = Field(
        None, ge=0, le=MAX_LOGPROBS, description="vLLM's: each prompt token's logprob, rank and the top k"
    )
    suffix: Unsupported = None

    def sampling_options(self) -> dict:
        return super().sampling_options() | {"prompt_logprobs": self.prompt_logprobs}


class TokenizeRequest(Body):
    model_config = ConfigDict(json_schema_extra={"allOf": [{"anyOf": _one_of("prompt", "messages")}]})
    model: Text | None = None
    prompt: Text | None = None
    messages: Annotated[list[ChatMessage], NonEmpty] | None = None
    add_special_tokens: bool | None = None


class CompressRequest(PromptCompression):
    """POST /v1/compress: a prompt or messages, compressed as `prompt_compression` would compress them."""

    model_config = ConfigDict(
        json_schema_extra={
            "allOf": [{"anyOf": _one_of("rate", "target_tokens")}, {"anyOf": _one_of("prompt", "messages")}]
        }
    )

    model: Text | None = Field(None, description="the model whose tokens are counted (default: the scorer's)")
    prompt: Text | None = None
    messages: Annotated[list[ChatMessage], NonEmpty] | None = None


class DetokenizeRequest(Body):
    model: Text | None = None
    tokens: list[Annotated[int, Field(ge=0)]]


def _structured(name: str, value) -> StructuredOutput | None:
    if name == "response_format":
        if value.type == "text":
            return None
        if value.type == "json_object":
            return StructuredOutput("json_object", None, name)
        if value.json_schema is None:
            raise ValueError("response_format: json_schema is required when type is 'json_schema'")
        return StructuredOutput("json", value.json_schema.schema_ or {}, name)
    if name == "structured_outputs":
        given = {key: item for key, item in value if item is not None and item is not False}
        if len(given) != 1:
            raise ValueError("structured_outputs: give exactly one of json, regex, choice, grammar, json_object")
        [(key, item)] = given.items()
        kind = {"json_": "json", "json_object": "json_object"}.get(key, key)
        return StructuredOutput(kind, None if kind == "json_object" else item, name)
    if name == "guided_json" and isinstance(value, str):
        value = _json_text(name, value)
    return StructuredOutput(name.removeprefix("guided_"), value, name)


def _json_text(name: str, text: str):
    try:
        return json.loads(text)
    except ValueError as error:
        raise ValueError(f"{name}: not a JSON schema ({error})") from None
