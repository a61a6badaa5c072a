"""Prompt compression in the server: `POST /v1/compress`, and the `prompt_compression` extension of chat and text
completions, which compresses a request's prompt before it is tokenized for prefill.

What is kept verbatim: system (and developer) messages, the final question (the last paragraph of the last message,
or of a text prompt; its last line or sentence when it has one paragraph), and the spans the caller lists in
`protected`; a prompt that is nothing else is a 400, not an answer that compressed nothing. The scorer is one served model (`--compression-
model`, default the smallest served); its work is billed as a ledger row of its own (purpose 'compression',
parent_request_id the client's x-request-id, model the scorer), admitted by the gate like any request's.
"""

import asyncio
import re
from dataclasses import dataclass
from types import SimpleNamespace

from carpool.economics.contract import Gate, Principal, part_request_id
from carpool.engine.tiers import DEFAULT_TIER
from carpool.server.compression.compressor import Budget, Compressed, Piece, compress, scoring_bound
from carpool.server.compression.scorer import EngineScorer
from carpool.server.errors import APIError
from carpool.server.generation import Generation
from carpool.server.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    CompressRequest,
    PromptCompression,
)
from carpool.server.serving import ModelServing, Serving, requested_tier


@dataclass
class Applied:
    """A request's compression: its prompt tokens before, for usage and the ledger."""

    original_prompt_tokens: int


class CompressionService:
    def __init__(self, serving: Serving, gate: Gate, model_name: str | None = None):
        self.serving, self.gate = serving, gate
        if model_name is None:  # the smallest served model scores: its compute is the overhead
            model_name = min(serving.models, key=lambda name: _num_parameters(serving.models[name]))
        if model_name not in serving.models:
            raise ValueError(f"compression_model: {model_name!r} is not served (served: {', '.join(serving.models)})")
        self.model_name = model_name

    # Surfaces ------------------------------------------------------------------------------------------

    async def compress_body(self, body: CompressRequest, principal: Principal, client_request_id: str) -> dict:
        """POST /v1/compress: the compressed prompt or messages, with token counts in `model`'s tokens."""
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "prompt: give exactly one of prompt and messages", param="prompt")
        target = self.serving.model(body.model or self.model_name)
        pieces = _question_pieces(body.prompt, 0) if body.prompt is not None else _message_pieces(body.messages)
        result = await self._compress(
            pieces, body, target, principal, DEFAULT_TIER, client_request_id, _cache_salt(body, principal)
        )
        answer = {
            "object": "compression",
            "model": target.model_name,
            "scorer_model": self.model_name,
            "original_tokens": result.original_tokens,
            "compressed_tokens": result.compressed_tokens,
            "target_tokens": result.target_tokens,
            "kept_ratio": round(result.kept_ratio, 4),
        }
        if body.prompt is not None:
            return answer | {"prompt": result.texts[0]}
        return answer | {"messages": [m.model_dump(exclude_none=True) for m in _replaced(body.messages, result)]}

    async def apply(
        self, body: ChatCompletionRequest | CompletionRequest, principal: Principal, client_request_id: str
    ):
        """The body with its prompt compressed (and `prompt_compression` cleared), and what it was before;
        (body, None) when the body does not ask."""
        asked = body.prompt_compression
        if asked is None:
            return body, None
        if body.model is not None and body.model not in self.serving.models:
            raise APIError(
                400,
                f"prompt_compression: not available for {body.model!r}, which is not a served model",
                param="prompt_compression",
            )
        # The start's checks first, in a thread (tokenizing, compiling a grammar): a request it would refuse
        # must not run and bill the scorer.
        await asyncio.to_thread(self.serving.check, body, principal)
        target = self.serving.model(body.model)
        tier, salt = requested_tier(body), _cache_salt(body, principal)
        if isinstance(body, ChatCompletionRequest):
            original = len(
                target.engine.door.tokenize_prompt(target.chat_prompt(body.messages, target._tools(body)[0]))
            )
            result = await self._compress(
                _message_pieces(body.messages), asked, target, principal, tier, client_request_id, salt
            )
            body = body.model_copy(update={"messages": _replaced(body.messages, result), "prompt_compression": None})
            return body, Applied(original)
        prompts = [body.prompt] if isinstance(body.prompt, str) else body.prompt
        if not all(isinstance(prompt, str) for prompt in prompts):
            raise APIError(
                400,
                "prompt_compression: needs a text prompt (token ids cannot be compressed)",
                param="prompt_compression",
            )
        original = sum(len(target.engine.door.tokenize_prompt(prompt)) for prompt in prompts)
        compressed = []
        for index, prompt in enumerate(prompts):
            result = await self._compress(
                _question_pieces(prompt, 0), asked, target, principal, tier, client_request_id, salt, index
            )
            compressed.append(result.texts[0])
        prompt = compressed[0] if isinstance(body.prompt, str) else compressed
        return body.model_copy(update={"prompt": prompt, "prompt_compression": None}), Applied(original)

    @staticmethod
    def started(started: tuple, applied: Applied | None) -> tuple:
        """(generation, format) from the serving start, its usage now reporting the prompt before compression."""
        if applied is not None:
            generation: Generation = started[0]
            generation.original_prompt_tokens = applied.original_prompt_tokens
        return started

    # The work --------------------------------------------------------------------------------------------

    async def _compress(
        self,
        pieces: list[Piece],
        asked: PromptCompression,
        target: ModelServing,
        principal: Principal,
        tier: str,
        client_request_id: str,
        cache_salt: str | None,
        prompt_index: int = 0,
    ) -> Compressed:
        """`prompt_index`: which of a text completion's prompts this is; each one's scoring is a row of its own."""
        try:
            budget = Budget(rate=asked.rate, target_tokens=asked.target_tokens)
        except ValueError as error:
            raise APIError(400, str(error), param="prompt_compression") from error
        pieces = _protect(pieces, asked.protected or [])
        if all(piece.protected for piece in pieces):
            field = "prompt_compression"
            if isinstance(asked, CompressRequest):  # /v1/compress: the body's own prompt or messages
                field = "prompt" if asked.prompt is not None else "messages"
            raise APIError(
                400,
                f"{field}: nothing can be compressed: the prompt is only what is kept verbatim (one sentence, the final "
                "question; system messages; protected spans); send it uncompressed, or a longer prompt",
                param=field,
            )
        scorer_serving = self.serving.models[self.model_name]
        scorer = EngineScorer(scorer_serving.engine, self.model_name, tier, cache_salt)
        row_id = part_request_id(
            client_request_id, "compression" if prompt_index == 0 else f"compression-{prompt_index}"
        )
        self.gate.admit(principal, tier, scoring_bound(pieces, scorer), request_id=row_id, model=self.model_name)
        tokenizer = target.tokenizer
        try:
            result = await compress(
                pieces,
                budget,
                scorer,
                lambda texts: sum(len(tokenizer.encode(text, add_special_tokens=False)) for text in texts),
            )
        finally:  # always recorded, zero tokens included: the record settles the admission's reservation, and
            # the scorer's work is billed even when the request fails during or after it
            durable = self.gate.record(principal, scorer.usage_record(principal, row_id, client_request_id))
            if durable is not None:
                await asyncio.wrap_future(durable)
        return result


def _num_parameters(serving: ModelServing) -> int:
    """Approximately, from the config: a replica router's engine (carpool.server.replicas) holds no weights."""
    config = serving.engine.engine.model_config
    per_layer = config.hidden_size * (4 * config.hidden_size + 3 * config.intermediate_size)
    return config.num_layers * per_layer + config.vocab_size * config.hidden_size


def _cache_salt(body, principal: Principal) -> str | None:
    """The scorer reads only the cached prefixes the request itself could (its key, cache_salt or user: the
    serving rule); /v1/compress has neither cache_salt nor user, so its key's."""
    return ModelServing._cache_salt(
        SimpleNamespace(cache_salt=getattr(body, "cache_salt", None), user=getattr(body, "user", None)), principal
    )


def _question_pieces(text: str, group: int) -> list[Piece]:
    """A text: its final question protected, the rest compressible. The question is the last paragraph; in a text
    of one paragraph, its last line; in one line, its last sentence (a 90,000-token paragraph is otherwise all
    question, and nothing could be compressed)."""
    body = text.rstrip()
    for boundary in (_PARAGRAPH_END, _LINE_END, _SENTENCE_END):
        cuts = [match.end() for match in boundary.finditer(body)]
        if cuts:
            return [Piece(text[: cuts[-1]], False, group), Piece(text[cuts[-1] :], True, group)]
    return [Piece(text, True, group)]


_PARAGRAPH_END, _LINE_END = re.compile(r"\n\n"), re.compile(r"\n")
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=\S)")  # the space after a sentence's stop, before the next sentence


def _message_pieces(messages: list[ChatMessage]) -> list[Piece]:
    pieces = []
    for i, message in enumerate(messages):
        if message.role in ("system", "developer"):
            pieces.append(Piece(message.text, True, i))
        elif i == len(messages) - 1:
            pieces.extend(_question_pieces(message.text, i))
        else:
            pieces.append(Piece(message.text, False, i))
    return pieces


def _protect(pieces: list[Piece], spans: list[str]) -> list[Piece]:
    """Compressible pieces split around every occurrence of a protected span, which becomes a protected piece."""
    for span in (s for s in spans if s):
        split = []
        for piece in pieces:
            if piece.protected or span not in piece.text:
                split.append(piece)
                continue
            parts = piece.text.split(span)
            for k, part in enumerate(parts):
                if k:
                    split.append(Piece(span, True, piece.group))
                if part:
                    split.append(Piece(part, False, piece.group))
        pieces = split
    return pieces


def _replaced(messages: list[ChatMessage], result: Compressed) -> list[ChatMessage]:
    return [
        message.model_copy(update={"content": text}) if message.text != text else message
        for message, text in zip(messages, result.texts)
    ]
