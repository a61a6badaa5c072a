"""Request bodies of the OpenAI-compatible API. Validation is strict, so a wrong type is a 400 rather than
silently coerced ("3" is not 3); unknown fields are ignored, as clients send options this server has no use for.
Every optional field also takes null, which some clients send for "not set"."""

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from carpool.engine.sampling_params import MAX_LOGPROBS

# Service tier -> engine priority (lower is served first). `batch` is internal: only the Batch API uses it.
TIERS = {"priority": 0, "default": 1, "flex": 2, "batch": 3}
MAX_CHOICES = 128  # n times the number of prompts
MAX_STOP_STRINGS = 4

NonEmpty = Field(min_length=1)


class Body(BaseModel):
    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="ignore")


class StreamOptions(Body):
    include_usage: bool | None = None


class TextPart(Body):
    type: Literal["text"]
    text: str


class ChatMessage(Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | Annotated[list[TextPart], NonEmpty] | None = None
    name: str | None = None

    @property
    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class GenerationRequest(Body):
    """What chat and text completions share."""

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    n: int | None = Field(None, ge=1, le=MAX_CHOICES)
    stop: str | Annotated[list[str], Field(max_length=MAX_STOP_STRINGS)] | None = None
    seed: int | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    user: str | None = None
    cache_salt: str | None = Field(None, max_length=256, description="prefix-cache tenant; default: the API key, else user")
    service_tier: Literal["auto", "default", "flex", "priority"] | None = None
    # Extensions, with vLLM's names and meanings.
    top_k: int | None = Field(None, ge=-1, description="-1 or 0: no limit")
    min_p: float | None = Field(None, ge=0, le=1)
    priority: int | None = Field(None, ge=0, le=2, description="the tier by number: 0 priority, 1 default, 2 flex")
    ignore_eos: bool | None = None


class ChatCompletionRequest(GenerationRequest):
    messages: Annotated[list[ChatMessage], NonEmpty]
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)


class CompletionRequest(GenerationRequest):
    prompt: (
        str
        | Annotated[list[str], NonEmpty]
        | Annotated[list[int], NonEmpty]
        | Annotated[list[Annotated[list[int], NonEmpty]], NonEmpty]
    )
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)


class TokenizeRequest(Body):
    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], NonEmpty] | None = None
    add_special_tokens: bool | None = None


class DetokenizeRequest(Body):
    model: str | None = None
    tokens: list[int]
