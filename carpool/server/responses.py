"""Engine outputs as the JSON the OpenAI clients parse: whole responses, stream chunks and logprobs.

One formatter per request; a streaming one remembers what it has sent per choice (the role goes out once,
completion logprobs carry running text offsets).
"""

from collections.abc import Mapping

from carpool.engine.outputs import RequestOutput
from carpool.engine.sequence import TokenLogprob
from carpool.server.generation import Choice, Generation
from carpool.server.tool_calls import ToolCallParser, parse_tool_calls


class _Format:
    def __init__(self, tokenizer, logprobs: bool):
        self.tokenizer, self.logprobs = tokenizer, logprobs
        self._started: set[int] = set()

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def envelope(self, gen: Generation, obj: str, choices: list[dict]) -> dict:
        return {
            "id": gen.request_id,
            "object": obj,
            "created": gen.created,
            "model": gen.model_name,
            "choices": choices,
            "service_tier": gen.tier,
            "system_fingerprint": None,
        }

    def response(self, gen: Generation) -> dict:
        body = self.envelope(gen, self.response_object, [self.choice(c) for c in gen.shown_choices()])
        return body | {"usage": gen.usage()}

    def chunk(self, gen: Generation, choice: Choice, output: RequestOutput) -> dict | None:
        """The stream chunk for one output, or None when it adds nothing the client could see."""
        first = choice.index not in self._started
        self._started.add(choice.index)
        if not (first or output.delta_text or output.finished or (self.logprobs and output.delta_logprobs)):
            return None
        body = self.envelope(gen, self.chunk_object, [self.chunk_choice(choice, output, first)])
        return body | {"usage": None}

    def usage_chunk(self, gen: Generation) -> dict:
        return self.envelope(gen, self.chunk_object, []) | {"usage": gen.usage()}


class ChatFormat(_Format):
    """With `tools` (the request rendered tools: each function's name and parameters schema), tool calls in the
    output become `tool_calls` and the finish_reason "tool_calls"; a stream sends each call whole, once its closing
    tag is out."""

    response_object = "chat.completion"
    chunk_object = "chat.completion.chunk"

    def __init__(self, tokenizer, logprobs: bool, tools: Mapping[str, dict | None] | None = None):
        super().__init__(tokenizer, logprobs)
        self.tools = tools
        self.parsers: dict[int, ToolCallParser] | None = {} if tools is not None else None

    def chunk(self, gen: Generation, choice: Choice, output: RequestOutput) -> dict | None:
        body = super().chunk(gen, choice, output)
        sent = body and body["choices"][0]
        if sent and not (sent["delta"] or sent["finish_reason"] or (sent["logprobs"] or {}).get("content")):
            return None  # text the tool-call parser holds back: nothing the client could see
        return body

    def choice(self, choice: Choice) -> dict:
        output = choice.last
        message = {"role": "assistant", "content": output.text, "refusal": None}
        finish_reason = output.finish_reason
        if self.parsers is not None:
            message["content"], calls = parse_tool_calls(output.text, self.tools)
            if calls:
                message["tool_calls"] = calls
                finish_reason = _tool_calls_finish(finish_reason)
        return {
            "index": choice.index,
            "message": message,
            "logprobs": self._logprobs(output.logprobs or []) if self.logprobs else None,
            "finish_reason": finish_reason,
        }

    def chunk_choice(self, choice: Choice, output: RequestOutput, first: bool) -> dict:
        delta, finish_reason = {"content": output.delta_text}, output.finish_reason
        if self.parsers is not None:
            parser = self.parsers.setdefault(choice.index, ToolCallParser(self.tools))
            content, calls = parser.feed(output.text, output.finished)
            # As OpenAI streams calls: no `"content": ""` beside them or for text held back (null in the first).
            delta = {"content": content} if content else {"content": None} if first else {}
            if calls:
                delta["tool_calls"] = calls
            if parser.calls and output.finished:
                finish_reason = _tool_calls_finish(finish_reason)
        return {
            "index": choice.index,
            "delta": {"role": "assistant"} | delta if first else delta,
            "logprobs": self._logprobs(output.delta_logprobs) if self.logprobs else None,
            "finish_reason": finish_reason if output.finished else None,
        }

    def _logprobs(self, logprobs: list[TokenLogprob]) -> dict:
        def entry(token_id: int, logprob: float) -> dict:
            text = self.token_text(token_id)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

        content = [
            entry(lp.token_id, lp.logprob) | {"top_logprobs": [entry(t, p) for t, p in lp.top]} for lp in logprobs
        ]
        return {"content": content, "refusal": None}


def _tool_calls_finish(engine_reason: str | None) -> str | None:
    """A choice with calls finishes "tool_calls", unless max_tokens cut it: then "length" (as OpenAI and vLLM
    report it), so a client can tell that a call may be missing; the unclosed `<tool_call>` text stays content."""
    return engine_reason if engine_reason == "length" else "tool_calls"


class CompletionFormat(_Format):
    response_object = "text_completion"
    chunk_object = "text_completion"

    def __init__(self, tokenizer, logprobs: bool):
        super().__init__(tokenizer, logprobs)
        self._offsets: dict[int, int] = {}  # choice index -> text offset of its next token

    def choice(self, choice: Choice) -> dict:
        output = choice.last
        return {
            "index": choice.index,
            "text": choice.echo + output.text,
            "logprobs": self._logprobs(choice, output.logprobs or []) if self.logprobs else None,
            "finish_reason": output.finish_reason,
        } | ({} if output.prompt_logprobs is None else {"prompt_logprobs": self._prompt_logprobs(output)})

    def _prompt_logprobs(self, output: RequestOutput) -> list[dict | None]:
        """vLLM's shape: None for the first token, then {token id: {logprob, rank, decoded_token}} holding the
        prompt's token and the top k."""
        return [
            None
            if lp is None
            else {
                str(token): {"logprob": logprob, "rank": rank, "decoded_token": self.token_text(token)}
                for token, logprob, rank in [(lp.token_id, lp.logprob, lp.rank)]
                + [(t, p, r) for r, (t, p) in enumerate(lp.top, start=1)]
            }
            for lp in output.prompt_logprobs
        ]

    def chunk_choice(self, choice: Choice, output: RequestOutput, first: bool) -> dict:
        return {
            "index": choice.index,
            "text": choice.echo + output.delta_text if first else output.delta_text,
            "logprobs": self._logprobs(choice, output.delta_logprobs) if self.logprobs else None,
            "finish_reason": output.finish_reason if output.finished else None,
        }

    def _logprobs(self, choice: Choice, logprobs: list[TokenLogprob]) -> dict:
        tokens = [self.token_text(lp.token_id) for lp in logprobs]
        offsets = []
        for text in tokens:
            offsets.append(self._offsets.get(choice.index, 0))
            self._offsets[choice.index] = offsets[-1] + len(text)
        return {
            "tokens": tokens,
            "token_logprobs": [lp.logprob for lp in logprobs],
            "top_logprobs": [{self.token_text(t): p for t, p in lp.top} for lp in logprobs],
            "text_offset": offsets,
        }
