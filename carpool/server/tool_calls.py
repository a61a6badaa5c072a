"""Tool calling in the chat format of Qwen2.5 (and Hermes-style templates): the model writes each call as
`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, which becomes an OpenAI `tool_calls` entry.

`tool_choice` "required" or a named function constrains the output with a grammar of exactly such blocks, whose
JSON is each function's own schema: the arguments always parse and validate. "auto" leaves the text free but
constrains a call once the model opens one (the `<tool_call>` token: llguidance's structural-tag pattern, as
OpenAI's strict function calling behaves), so a tagged call's arguments also always validate. A bare call with no
tags (Qwen2.5-Coder 0.5B answers "What is the weather in Paris?" with just `{"name": "get_weather", "arguments":
{...}}`) is free text to the grammar: it becomes a call only when its arguments validate against the tool's
schema (jsonschema), and otherwise stays content, as vLLM leaves a call its parser cannot read. "none" renders no
tools and parses nothing.
"""

import json
import re
import uuid
from collections.abc import Mapping

import jsonschema

from carpool.engine.structured import StructuredOutput
from carpool.engine.structured.grammars import check_json_schema
from carpool.engine.structured.schemas import embedded

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_DECODER = json.JSONDecoder()
_SPACE = re.compile(r"\s*")


def check_tools(tools: list[dict]) -> None:
    """ValueError naming the tool unless each function's parameters are a JSON schema of an object that the grammar
    library accepts, and that jsonschema can check a bare call's arguments against: whatever tool_choice is, so
    "auto" takes the same tools as "required" (where they become the grammar), and a call's arguments are always a
    JSON object, as OpenAI's are."""
    for i, tool in enumerate(tools):
        parameters = tool["function"].get("parameters")
        if parameters is None:
            continue
        where = f"tools[{i}].function.parameters"
        if not isinstance(parameters, dict) or parameters.get("type", "object") != "object":
            raise ValueError(f'{where} must be a JSON schema of type "object"')
        check_json_schema(parameters, where)
        try:
            jsonschema.validators.validator_for(parameters).check_schema(parameters)
        except jsonschema.SchemaError as error:
            raise ValueError(f"{where}: invalid JSON schema: {error.message}") from None


def _call_rule(tools: list[dict], name: str | None, parallel: bool, closed: bool = True) -> str:
    """The Lark rule of one tagged block of calls of the function `name`, or of any tool: one call, or with
    `parallel` one or more, a line each; unless `closed`, the closing tag may be left out at the end of the
    output (the model may stop right after a call: ToolCallParser reads an unclosed block at the end of the output
    as its whole calls). Each function's parameters sit in
    the call schema's root `$defs` under the function's name (unique, and a JSON pointer as it is: check_tools),
    with their references moved there: `#/$defs/P` of two tools are two definitions."""
    functions = [tool["function"] for tool in tools if name is None or tool["function"]["name"] == name]
    parameters = {
        f["name"]: embedded(f.get("parameters") or {"type": "object", "properties": {}}, f"/$defs/{f['name']}", "tools")
        for f in functions
    }
    calls = [
        {
            "type": "object",
            "additionalProperties": False,
            "required": ["name", "arguments"],
            "properties": {"name": {"const": f["name"]}, "arguments": {"$ref": f"#/$defs/{f['name']}"}},
        }
        for f in functions
    ]
    schema = json.dumps({"$defs": parameters} | (calls[0] if len(calls) == 1 else {"anyOf": calls}))
    # The tags are single tokens in Qwen's vocabulary, named as tokens: llguidance treats every added token as
    # special, so the tag spelled as a "string" is matched by the token's text but not accepted by the parser.
    # Qwen2.5-Coder 0.5B asked for the weather of two cities writes its second call on the next line of the same
    # block (top logprob at the closing tag: `{"`, -0.01); a grammar of one call per block made it end after one.
    more = ' ("\\n" one_call)*' if parallel else ""
    close = f'"\\n" {CLOSE}' if closed else f'("\\n" {CLOSE})?'
    return f'call: {OPEN} "\\n" one_call{more} {close}\none_call: %json {schema}\n'


def call_grammar(tools: list[dict], name: str | None, parallel: bool) -> StructuredOutput:
    """One call (of the function `name`, or of any tool), or with `parallel` one or more, and nothing else."""
    # After `</tool_call>` Qwen writes "\n"; if only another call could follow it, the model is pushed to call
    # again until max_tokens (measured: 6 repeated calls in 150 tokens, 1 call in 22 with the optional "\n").
    # Qwen2.5-Coder 0.5B's top token after a call's JSON is <|im_end|> (-0.00), not "\n" and the closing tag: a
    # grammar that forced the tag made it write the next call instead (`{"` outranked `</tool_call>` once the end
    # was masked), 8 calls of the same Paris weather until max_tokens. So the output may end right after a call.
    repeat = ' ("\\n" call)* "\\n"?' if parallel else ""
    rule = _call_rule(tools, name, parallel, closed=False)
    return StructuredOutput("grammar", f"start: call{repeat}\n" + rule, "tools")


def auto_grammar(tools: list[dict], parallel: bool) -> StructuredOutput:
    """Free text, in which each call the model opens (with `parallel`, any number; else at most one) is a call of
    one of the tools with arguments that validate. TEXT cannot hold the `<tool_call>` token, so the token ends it
    and the call's schema takes over."""
    calls = "tagged*" if parallel else "tagged?"
    lark = f"start: {calls} TEXT\ntagged: TEXT call\nTEXT: /(.|\\n)*/\n" + _call_rule(tools, None, parallel)
    return StructuredOutput("grammar", lark, "tools")


class ToolCallParser:
    """Splits one choice's output text into content and complete tool calls, as the text grows: `feed(text)`
    with the whole text so far returns what is new since the last feed. A call still being written (or the start
    of an OPEN tag) is held back until it completes; at the end, whatever never became a call is content. An
    output that starts with "{" is held to the end: the whole of it may be a bare call of one of `tools` (each
    function's name and its parameters schema, None for none). A call becomes a call only when it names one of
    `tools` and its arguments validate against that tool's schema."""

    def __init__(self, tools: Mapping[str, dict | None]):
        self.tools = tools
        self.cursor = 0  # text before this is sent, as content or calls
        self.pending = ""  # whitespace content held until something follows it (none is sent between calls)
        self.calls: list[dict] = []

    def feed(self, text: str, finished: bool) -> tuple[str, list[dict]]:
        # No content sent yet (a whitespace-only first delta moves the cursor but is held in `pending`).
        if not text[: self.cursor].strip() and not self.calls and text.lstrip().startswith("{"):
            if not finished:
                return "", []
            calls = _parse_calls(text, 0, self.tools)
            if calls:
                self.calls += calls
                self.cursor = len(text)
                return "", calls
        content, calls = "", []
        while True:
            start = text.find(OPEN, self.cursor)
            if start < 0:
                end = len(text) if finished else _held_back(text, self.cursor)
                content += self._content(text[self.cursor : end], finished)
                self.cursor = end
                return content, calls
            content += self._content(text[self.cursor : start], False)
            close = text.find(CLOSE, start)
            if close < 0:
                if finished:  # cut by max_tokens: the block's whole calls are calls, the rest content
                    cut, rest = _leading_calls(text[start + len(OPEN) :], len(self.calls), self.tools)
                    self.calls += cut
                    calls += cut
                    content += self._content(rest if cut else text[start:], True)
                    self.cursor = len(text)
                return content, calls
            block = _parse_calls(text[start + len(OPEN) : close], len(self.calls), self.tools)
            if not block:  # no call of one of the request's tools
                content += self._content(text[start : close + len(CLOSE)], False)
            else:
                self.calls += block
                calls += block
                self.pending = ""
            self.cursor = close + len(CLOSE)

    def _content(self, text: str, finished: bool) -> str:
        text = self.pending + text
        if not text.strip():
            self.pending = "" if finished else text
            return ""
        self.pending = ""
        return text.strip() if self.calls else text


def _held_back(text: str, cursor: int) -> int:
    """Where sendable text ends: before a suffix that could be the start of an OPEN tag."""
    for size in range(min(len(OPEN) - 1, len(text) - cursor), 0, -1):
        if OPEN.startswith(text[len(text) - size :]):
            return len(text) - size
    return len(text)


def _parse_calls(body: str, index: int, tools: Mapping[str, dict | None]) -> list[dict]:
    """The calls a block (or a bare output) holds: one JSON call, or several one after another (a line each, as
    the parallel grammar writes them); none unless every one of them is a call of one of `tools`."""
    calls, rest = _leading_calls(body, index, tools)
    return [] if rest else calls


def _leading_calls(body: str, index: int, tools: Mapping[str, dict | None]) -> tuple[list[dict], str]:
    """The calls at the start of `body`, one after another, and the text from the first thing that is not one."""
    calls, at = [], _SPACE.match(body).end()
    while at < len(body):
        try:
            value, end = _DECODER.raw_decode(body, at)
        except ValueError:
            break
        call = _call(value, index + len(calls), tools)
        if call is None:
            break
        calls.append(call)
        at = _SPACE.match(body, end).end()
    return calls, body[at:]


def _call(call, index: int, tools: Mapping[str, dict | None]) -> dict | None:
    if not isinstance(call, dict) or call.get("name") not in tools:
        return None
    arguments = call.get("arguments", call.get("parameters", {}))
    if not arguments_valid(arguments, tools[call["name"]]):
        return None
    return {
        "index": index,
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": call["name"], "arguments": json.dumps(arguments, ensure_ascii=False)},
    }


def arguments_valid(arguments, parameters: dict | None) -> bool:
    """Whether a call's arguments are what the function takes: a JSON object valid against its parameters schema
    (any object when it has none). check_tools has already had the schema compiled by the grammar library."""
    if not isinstance(arguments, dict):
        return False
    return parameters is None or jsonschema.validators.validator_for(parameters)(parameters).is_valid(arguments)


def parse_tool_calls(text: str, tools: Mapping[str, dict | None]) -> tuple[str | None, list[dict]]:
    """A whole output's content (None when it is only calls) and its calls, without the stream's `index`."""
    content, calls = ToolCallParser(tools).feed(text, finished=True)
    return (content.strip() or None) if calls else text, [{k: v for k, v in c.items() if k != "index"} for c in calls]


def template_arguments(arguments: str):
    """A call's arguments as the chat template wants them (Qwen's prints them with `tojson`): the JSON object,
    or the text as it is when it is not JSON."""
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments
