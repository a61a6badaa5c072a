"""From a validated request body to a running Generation: the model it names, tier checks, prompts to token ids,
sampling parameters per choice, context-length checks, then the model's tier queue and the gate's admission."""

import asyncio
import concurrent.futures
import contextvars
import threading
import uuid
from collections.abc import Awaitable, Callable

from carpool.economics.contract import Principal, UsageRecord
from carpool.engine.door import ContextLengthExceeded
from carpool.engine.request import CacheBreakpoint, EngineRequest
from carpool.engine.sampling_params import SamplingParams
from carpool.engine.structured import StructuredOutput
from carpool.engine.tiers import BY_PRIORITY, DEFAULT_TIER
from carpool.server.errors import APIError
from carpool.server.generation import Backends, Choice, Generation
from carpool.server.protocol import (
    MAX_CHOICES,
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    DetokenizeRequest,
    GenerationRequest,
    TokenizeRequest,
)
from carpool.server.responses import ChatFormat, CompletionFormat
from carpool.server.tool_calls import auto_grammar, call_grammar, check_tools, template_arguments

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's documented default for /v1/completions
# Set while a start runs on a worker thread (Serving.started): the event loop its queue and Generation belong to,
# and the event its client's leaving sets.
_CALLER_LOOP: contextvars.ContextVar[asyncio.AbstractEventLoop | None] = contextvars.ContextVar(
    "caller_loop", default=None
)
_CLIENT_LEFT: contextvars.ContextVar[threading.Event | None] = contextvars.ContextVar("client_left", default=None)


class ClientLeft(Exception):
    """The client hung up while its request was admitted on a worker thread: nothing was started for it."""


class Serving:
    """Every served model by name, in the order served. A request goes to the model its `model` names; one that
    names none goes to the first, as in vLLM."""

    def __init__(self, models: list[Backends]):
        self.models = {backends.model_name: ModelServing(backends) for backends in models}
        self.default = next(iter(self.models.values()))

    def model(self, name: str | None) -> "ModelServing":
        if name is not None and name not in self.models:
            served = ", ".join(repr(served) for served in self.models)
            raise APIError(
                404,
                f"The model {name!r} does not exist; this server serves {served}.",
                param="model",
                code="model_not_found",
            )
        serving = self.default if name is None else self.models[name]
        if serving.engine.error is not None:  # the other models still serve (see /health)
            raise APIError(
                503,
                f"The model {serving.model_name!r} is unavailable: its engine failed ({serving.engine.error!r}).",
                code="model_unavailable",
            )
        return serving

    @property
    def max_num_seqs(self) -> int:
        """Sequence slots across every model's engine."""
        return sum(serving.engine.config.max_num_seqs for serving in self.models.values())

    def constraint(self, request: GenerationRequest) -> StructuredOutput | None:
        return self.model(request.model).constraint(request)

    def compile_constraint(self, request: GenerationRequest, spec: StructuredOutput) -> None:
        self.model(request.model).compile_constraint(spec)

    async def precompile(self, request: GenerationRequest) -> None:
        """The request's constraint compiled off the event loop before its start (see ModelServing.
        compile_constraint), and no thread hop for requests without one."""
        spec = self.constraint(request)
        if spec is not None:
            await asyncio.to_thread(self.compile_constraint, request, spec)

    def start_chat(
        self,
        request: ChatCompletionRequest,
        principal: Principal,
        request_id: str | None = None,
        cache_breakpoints: tuple[CacheBreakpoint, ...] = (),
    ) -> tuple[Generation, ChatFormat]:
        return self.model(request.model).start_chat(
            request, principal, request_id=request_id, cache_breakpoints=cache_breakpoints
        )

    async def started(
        self,
        start,
        request: GenerationRequest,
        principal: Principal,
        request_id: str | None = None,
        disconnected: Callable[[], Awaitable[None]] | None = None,
    ):
        """`start(request, principal)` (start_chat or start_completion). With a gate whose admission is a round
        trip to a database server (PostgreSQL: `admits_remotely`), on a worker thread, so a slow or unreachable
        database holds up this request only, not every stream on the event loop; its tier queue and Generation
        are still handled on the loop. `disconnected` returns once the client has gone: one that leaves while
        admission waits gets no Generation (ClientLeft), and its engine work never starts."""
        if not getattr(self.model(request.model).gate, "admits_remotely", False):
            return start(request, principal, request_id=request_id)
        left = threading.Event()
        watcher = asyncio.create_task(_set_when(disconnected, left)) if disconnected is not None else None
        tokens = _CALLER_LOOP.set(asyncio.get_running_loop()), _CLIENT_LEFT.set(left)
        try:
            return await asyncio.to_thread(start, request, principal, request_id=request_id)
        finally:
            _CALLER_LOOP.reset(tokens[0])
            _CLIENT_LEFT.reset(tokens[1])
            if watcher is not None:
                watcher.cancel()

    def check(self, request: ChatCompletionRequest | CompletionRequest, principal: Principal) -> None:
        """The start's every check of `request` (the 400 it would answer), without starting or admitting it: for
        work billed before the start (a compression, a cascade's earlier steps) not to run for a request that
        fails. A prompt still to be compressed is not held to the context length."""
        serving = self.model(request.model)
        if isinstance(request, ChatCompletionRequest):
            serving.start_chat(request, principal, check_only=True)
        else:
            serving.start_completion(request, principal, check_only=True)

    def start_completion(
        self, request: CompletionRequest, principal: Principal, request_id: str | None = None
    ) -> tuple[Generation, CompletionFormat]:
        return self.model(request.model).start_completion(request, principal, request_id=request_id)

    def tokenize(self, request: TokenizeRequest) -> dict:
        return self.model(request.model).tokenize(request)

    def detokenize(self, request: DetokenizeRequest) -> dict:
        return self.model(request.model).detokenize(request)


class ModelServing:
    """One served model: its engine's tokenizer and chat template, its tier queues, its metrics."""

    def __init__(self, backends: Backends):
        self.backends = backends
        self.engine, self.gate, self.queues = backends.engine, backends.gate, backends.queues
        self.model_name = backends.model_name
        self.tokenizer = backends.engine.tokenizer

    def chat_prompt(
        self, messages: list[ChatMessage], tools: list[dict] | None = None, add_generation_prompt: bool = True
    ) -> str:
        turns = [
            {"role": "system" if m.role == "developer" else m.role, "content": m.text}
            | ({"name": m.name} if m.name is not None else {})
            | ({"tool_call_id": m.tool_call_id} if m.tool_call_id is not None else {})
            | (
                {
                    "tool_calls": [
                        {
                            "id": c.id,
                            "type": c.type,
                            "function": {
                                "name": c.function.name,
                                "arguments": template_arguments(c.function.arguments),
                            },
                        }
                        for c in m.tool_calls
                    ]
                }
                if m.tool_calls
                else {}
            )
            for m in messages
        ]
        try:
            return self.tokenizer.apply_chat_template(turns, add_generation_prompt, tools=tools)
        except Exception as error:  # a chat template is code run on the caller's input: its failures are theirs
            message = str(error) if str(error).startswith("messages") else f"messages: {error}"
            raise APIError(400, message, param="messages") from error

    def chat_prompt_ids(self, request: ChatCompletionRequest, add_generation_prompt: bool = True) -> list[int]:
        """The token ids of the prompt a chat request runs: its messages and (unless tool_choice is "none") its
        tools through the chat template."""
        tools = self._tools(request)[0]
        prompt = self.chat_prompt(request.messages, tools, add_generation_prompt)
        return self._tokenize(prompt, request, {"prompt": "messages"})

    # Generation -----------------------------------------------------------------------------------------

    def start_chat(
        self,
        request: ChatCompletionRequest,
        principal: Principal,
        check_only: bool = False,
        cache_breakpoints: tuple[CacheBreakpoint, ...] = (),
        request_id: str | None = None,
    ) -> tuple[Generation, ChatFormat] | None:
        """`cache_breakpoints`: prefixes of the prompt to keep cached for a TTL (the Anthropic route's)."""
        renamed = {"prompt": "messages"}
        if request.max_completion_tokens is not None:
            renamed["max_tokens"] = "max_completion_tokens"
        if request.top_logprobs is not None and not request.logprobs:
            raise APIError(400, "top_logprobs: requires logprobs to be true", param="top_logprobs")
        tools, structured = self._tools(request)
        prompt_ids = self._tokenize(self.chat_prompt(request.messages, tools), request, renamed)
        max_tokens = request.max_completion_tokens or request.max_tokens
        logprobs = (request.top_logprobs or 0) if request.logprobs else None
        gen = self._start(
            request,
            principal,
            [prompt_ids],
            max_tokens,
            logprobs,
            renamed,
            structured=structured or self._structured(request),
            check_only=check_only,
            cache_breakpoints=cache_breakpoints,
            request_id=request_id,
        )
        if check_only:
            return None
        schemas = (
            None if tools is None else {tool["function"]["name"]: tool["function"].get("parameters") for tool in tools}
        )
        return gen, ChatFormat(self.tokenizer, logprobs is not None, tools=schemas)

    def _tools(self, request: ChatCompletionRequest) -> tuple[list[dict] | None, StructuredOutput | None]:
        """The tools the chat template renders (None: no tools, or tool_choice "none") and, for tool_choice
        "required" or a named function, the grammar that makes the output those calls."""
        choice = request.tool_choice
        if not request.tools:
            if choice not in (None, "none", "auto"):
                raise APIError(400, "tool_choice: requires tools", param="tool_choice")
            return None, None
        if choice == "none":
            return None, None
        if not self.tokenizer.supports_tools:
            raise APIError(
                400,
                f"tools: the model {self.model_name!r} does not support tool calling (its chat template has no tools)",
                param="tools",
            )
        tools = [tool.model_dump(exclude_none=True) for tool in request.tools]
        try:
            check_tools(tools)
        except ValueError as error:
            raise APIError.from_value_error(error, type(request).model_fields) from error
        parallel = request.parallel_tool_calls is not False
        if choice is None or choice == "auto":  # a response_format's constraint, if any, is the one that applies
            return tools, None if self._structured(request) is not None else auto_grammar(tools, parallel)
        name = None if choice == "required" else choice.function.name
        if name is not None and name not in {tool["function"]["name"] for tool in tools}:
            raise APIError(400, f"tool_choice: no tool is named {name!r}", param="tool_choice")
        if self._structured(request) is not None:
            raise APIError(
                400,
                "tool_choice: a required or named tool call cannot be combined with "
                "response_format or structured_outputs",
                param="tool_choice",
            )
        try:  # the grammar of many large tools can pass the spec size limit: the client's error, not ours
            return tools, call_grammar(tools, name, parallel)
        except ValueError as error:
            raise APIError.from_value_error(error, type(request).model_fields) from error

    def constraint(self, request: GenerationRequest) -> StructuredOutput | None:
        """What the request's output must match (its tools' call grammar or its structured output), not compiled."""
        tools = self._tools(request)[1] if isinstance(request, ChatCompletionRequest) else None
        return tools or self._structured(request)

    def compile_constraint(self, spec: StructuredOutput) -> None:
        """Compiles `spec` into the engine's cache, for the app to run in a thread before the start (whose compile
        then hits the cache): on the event loop, a new 64 KB schema (20-50 ms) and the first constrained request's
        tokenizer table (0.2-0.7 s) stall every stream and request."""
        try:
            self.engine.engine.grammars.bind(spec)
        except ValueError:
            return  # not cached: the start compiles it again and raises it as a 400 naming the parameter

    @staticmethod
    def _structured(request: GenerationRequest) -> StructuredOutput | None:
        try:
            return request.structured_output()
        except ValueError as error:
            raise APIError.from_value_error(error, type(request).model_fields) from error

    def start_completion(
        self,
        request: CompletionRequest,
        principal: Principal,
        check_only: bool = False,
        request_id: str | None = None,
    ) -> tuple[Generation, CompletionFormat] | None:
        prompt = request.prompt
        prompts = prompt if isinstance(prompt, list) and not isinstance(prompt[0], int) else [prompt]
        if request.echo and request.logprobs is not None:
            raise APIError(
                400,
                "echo: echo together with logprobs is not supported (prompt_logprobs gives the prompt's logprobs)",
                param="echo",
            )
        if request.prompt_logprobs is not None and request.stream:
            raise APIError(400, "prompt_logprobs: not supported when streaming", param="prompt_logprobs")
        n, best_of = request.n or 1, request.best_of or request.n or 1
        if best_of < n:
            raise APIError(400, f"best_of: must be at least n ({n}), got {best_of}", param="best_of")
        if best_of > n and request.stream:
            raise APIError(400, "best_of: streaming is not supported when best_of is greater than n", param="best_of")
        prompt_ids = [self._tokenize(p, request) for p in prompts]
        # Echo the prompt as given: its text, or the text of its token ids once the engine's door has checked them.
        echoes = prompts if request.echo else None
        max_tokens = request.max_tokens or COMPLETION_DEFAULT_MAX_TOKENS
        gen = self._start(
            request,
            principal,
            prompt_ids,
            max_tokens,
            request.logprobs,
            {},
            best_of,
            echoes,
            self._structured(request),
            check_only,
            request_id=request_id,
        )
        if check_only:
            return None
        return gen, CompletionFormat(self.tokenizer, request.logprobs is not None)

    def _tokenize(self, prompt: str | list[int], request: GenerationRequest, renamed=None) -> list[int]:
        try:
            return self.engine.door.tokenize_prompt(prompt)
        except ValueError as error:
            raise APIError.from_value_error(error, type(request).model_fields, renamed) from error

    def _start(
        self,
        request: GenerationRequest,
        principal: Principal,
        prompts: list[list[int]],
        max_tokens: int | None,
        logprobs: int | None,
        renamed: dict,
        best_of: int | None = None,
        echoes: list[str | list[int]] | None = None,
        structured: StructuredOutput | None = None,
        check_only: bool = False,
        cache_breakpoints: tuple[CacheBreakpoint, ...] = (),
        request_id: str | None = None,
    ) -> Generation | None:
        """Each prompt runs best_of (default n) candidates; with best_of > n the n best of each are returned.
        check_only: every check, then None (nothing reserved or admitted). `request_id`: its ledger row's
        (contract.UsageRecord: the client's x-request-id); default the response's id."""
        # The HTTP routes compress first and clear it; a batch line cannot.
        if request.prompt_compression is not None and not check_only:
            raise APIError(
                400, "prompt_compression: not supported here (only on the live /v1 routes)", param="prompt_compression"
            )
        tier = requested_tier(request)
        n = request.n or 1
        candidates = best_of or n
        if candidates * len(prompts) > MAX_CHOICES:
            name = "best_of" if candidates > n else "n"
            raise APIError(400, f"{name}: {name} times the number of prompts must be at most {MAX_CHOICES}", param=name)
        prefix = "chatcmpl" if isinstance(request, ChatCompletionRequest) else "cmpl"
        response_id = f"{prefix}-{uuid.uuid4().hex}"
        ledger_id = request_id or response_id
        cache_salt = self._cache_salt(request, principal)
        choices = []
        for i, prompt_ids in enumerate(prompts):
            echo = ""
            for j in range(candidates):
                params = self._params(
                    request,
                    prompt_ids,
                    max_tokens,
                    logprobs,
                    j,
                    renamed,
                    best_of=candidates if candidates > n else 1,
                    structured=structured,
                )
                try:
                    engine_request = self._engine_request(
                        request,
                        f"{response_id}-{len(choices)}",
                        prompt_ids,
                        params,
                        tier,
                        cache_salt,
                        renamed,
                        cache_breakpoints,
                    )
                except APIError as error:  # a prompt still to be compressed may be longer than the context
                    if (
                        check_only
                        and request.prompt_compression is not None
                        and error.code == "context_length_exceeded"
                    ):
                        continue
                    raise
                if echoes and j == 0:  # token ids are decoded only once the door has found them in the vocabulary
                    echo = echoes[i] if isinstance(echoes[i], str) else self.tokenizer.decode(prompt_ids)
                choices.append(Choice(len(choices), engine_request, bills_prompt=j == 0, prompt_index=i, echo=echo))
        if check_only:
            return None
        _on_loop(self.queues.reserve, tier, len(choices))
        try:
            self.gate.admit(
                principal,
                tier,
                sum(len(c.request.prompt_token_ids) + c.request.params.max_tokens for c in choices),
                request_id=ledger_id,
                model=self.model_name,
            )
        except BaseException:
            for _ in choices:
                _on_loop(self.queues.release, tier)
            raise
        left = _CLIENT_LEFT.get()
        if left is not None and left.is_set():  # the client left while admission waited: start nothing
            for _ in choices:
                _on_loop(self.queues.release, tier)
            self._record_unstarted(principal, tier, ledger_id)
            raise ClientLeft(ledger_id)
        return _on_loop(
            Generation,
            self.backends,
            response_id,
            tier,
            principal,
            choices,
            streaming=bool(request.stream),
            keep=n if candidates > n else None,
            ledger_id=ledger_id,
        )

    def _record_unstarted(self, principal: Principal, tier: str, request_id: str) -> None:
        """An admitted request that never ran: its row (no tokens, no cost) settles its admission's reservation."""
        nothing = dict.fromkeys(("prompt_tokens", "cached_tokens", "cache_write_tokens", "output_tokens"), 0)
        seconds = dict.fromkeys(("queue_seconds", "prefill_seconds", "decode_seconds"), 0.0)
        usage = UsageRecord(
            request_id=request_id,
            model=self.model_name,
            tier=tier,
            finish_reason="abort",
            key_id=principal.key_id,
            tenant=principal.tenant,
            **nothing,
            **seconds,
        )
        self.gate.record(principal, usage)

    @staticmethod
    def _cache_salt(request: GenerationRequest, principal: Principal) -> str | None:
        """Whose cached prefixes a request may reuse: its API key's, narrowed by an explicit cache_salt (a salt
        never reaches past its key: two keys sending the same salt share nothing), else its cache_salt's, else its
        user's. Requests with none of these (an open server, no user) share one cache."""
        key = None if principal.key_id is None else f"key:{principal.key_id}"
        if request.cache_salt is not None:
            return f"{key}:salt:{request.cache_salt}" if key else f"salt:{request.cache_salt}"
        if key:
            return key
        if request.user:
            return f"user:{request.user}"
        return None

    def _params(
        self,
        request: GenerationRequest,
        prompt_ids: list[int],
        max_tokens: int | None,
        logprobs: int | None,
        choice: int,
        renamed: dict,
        best_of: int = 1,
        structured: StructuredOutput | None = None,
    ) -> SamplingParams:
        try:
            return SamplingParams(
                max_tokens=max_tokens,  # None (chat without it): the rest of the window, as OpenAI's; the door settles it
                # Each of n choices gets its own seed, so they differ yet replay the same.
                seed=None if request.seed is None else request.seed + choice,
                logprobs=logprobs,
                best_of=best_of,
                structured=structured,
                **request.sampling_options(),
            )
        except ValueError as error:
            raise APIError.from_value_error(error, type(request).model_fields, renamed) from error

    def _engine_request(
        self,
        request: GenerationRequest,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        tier: str,
        cache_salt: str | None,
        renamed: dict,
        cache_breakpoints: tuple[CacheBreakpoint, ...] = (),
    ) -> EngineRequest:
        """Through the engine's door: the one check of the prompt's ids, its length and the params' tokens."""
        fields = type(request).model_fields
        try:
            return self.engine.door.request(
                request_id, prompt_ids, params, tier, cache_salt, cache_breakpoints=cache_breakpoints
            )
        except ContextLengthExceeded as error:
            raise APIError.from_value_error(error, fields, renamed, code="context_length_exceeded") from error
        except ValueError as error:
            raise APIError.from_value_error(error, fields, renamed) from error

    # Tokenizer endpoints -----------------------------------------------------------------------------------

    def tokenize(self, request: TokenizeRequest) -> dict:
        if (request.prompt is None) == (request.messages is None):
            raise APIError(400, "prompt: give exactly one of prompt and messages", param="prompt")
        text = request.prompt if request.prompt is not None else self.chat_prompt(request.messages)
        add_special_tokens = request.add_special_tokens is not False
        tokens = self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        return {"count": len(tokens), "max_model_len": self.engine.max_model_len, "tokens": tokens}

    def detokenize(self, request: DetokenizeRequest) -> dict:
        bad = [t for t in request.tokens if not 0 <= t < self.tokenizer.vocab_size]
        if bad:
            raise APIError(
                400, f"tokens: {bad[:5]} are outside the vocabulary [0, {self.tokenizer.vocab_size})", param="tokens"
            )
        return {"prompt": self.tokenizer.decode(request.tokens)}


def requested_tier(request: GenerationRequest) -> str:
    """The tier a request asks for, by name (`service_tier`) or number (`priority`); the default if neither."""
    asked = None if request.service_tier in (None, "auto") else request.service_tier
    numbered = BY_PRIORITY[request.priority].name if request.priority is not None else None
    if asked and numbered and asked != numbered:
        raise APIError(
            400,
            f"priority: {request.priority} names the {numbered!r} tier, but service_tier is {asked!r}",
            param="priority",
        )
    return asked or numbered or DEFAULT_TIER


async def _set_when(happened: Callable[[], Awaitable[None]], event: threading.Event) -> None:
    await happened()
    event.set()


def _on_loop(function, *args, **kwargs):
    """`function(*args, **kwargs)` on the event loop: at once when called there, else (a start on a worker thread,
    see Serving.started) handed to the loop and waited for."""
    loop = _CALLER_LOOP.get()
    if loop is None:
        return function(*args, **kwargs)
    done: concurrent.futures.Future = concurrent.futures.Future()

    def call():
        try:
            done.set_result(function(*args, **kwargs))
        except BaseException as error:
            done.set_exception(error)

    loop.call_soon_threadsafe(call, context=contextvars.Context())  # the Generation's tasks: no worker's context
    return done.result()
