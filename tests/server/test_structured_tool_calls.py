"""The tool-call parser alone (no model): Qwen's `<tool_call>` blocks become OpenAI tool calls, whole or as the
text streams in, with nothing of a call leaking into the content; and the tool_choice "auto" grammar, walked
with Qwen's tokenizer (no weights)."""

import json
from types import SimpleNamespace

import pytest

from carpool.engine.structured.grammars import GrammarCompiler
from carpool.models.loader import resolve_model_dir
from carpool.models.tokenizer import Tokenizer
from carpool.server.responses import ChatFormat
from carpool.server.tool_calls import ToolCallParser, auto_grammar, call_grammar, check_tools, parse_tool_calls

CITY = {
    "type": "object",
    "additionalProperties": False,
    "required": ["city"],
    "properties": {"city": {"type": "string", "maxLength": 20}},
}
NAMES = {"get_weather": CITY}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def test_whole_output_with_two_calls_and_text():
    content, calls = parse_tool_calls(f"Let me check.\n{CALL}\n{CALL.replace('Paris', 'Rome')}", NAMES)
    assert content == "Let me check."
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [{"city": "Paris"}, {"city": "Rome"}]
    assert all(c["type"] == "function" and c["function"]["name"] == "get_weather" for c in calls)
    assert len({c["id"] for c in calls}) == 2


def test_text_without_calls_or_with_a_broken_call_stays_content():
    assert parse_tool_calls("Just text.", NAMES) == ("Just text.", [])
    broken = "<tool_call>\n{not json}\n</tool_call>"
    assert parse_tool_calls(broken, NAMES) == (broken, [])
    cut = '<tool_call>\n{"name": "get_wea'  # max_tokens ended it mid-call
    assert parse_tool_calls(cut, NAMES) == (cut, [])


def test_streaming_holds_back_a_call_until_it_closes():
    text = f"Sure. {CALL}\n{CALL}"
    parser, content, calls = ToolCallParser(NAMES), "", []
    for end in range(1, len(text) + 1):
        delta, new = parser.feed(text[:end], finished=end == len(text))
        assert "<" not in delta  # not even the start of a tag reaches the content
        content += delta
        calls += new
    assert content.strip() == "Sure." and [c["index"] for c in calls] == [0, 1]
    assert all(json.loads(c["function"]["arguments"]) == {"city": "Paris"} for c in calls)


def test_required_grammar_names_each_tool_and_its_schema():
    tools = [{"type": "function", "function": {"name": n, "parameters": {"type": "object"}}} for n in ("a", "b")]
    both, only_b = call_grammar(tools, None, True).value, call_grammar(tools, "b", False).value
    assert '"const": "a"' in both and '"const": "b"' in both and "call)*" in both
    assert '"const": "a"' not in only_b and "call)*" not in only_b


def test_a_bare_call_of_a_known_tool_is_a_call_and_other_json_is_content():
    bare = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
    parser = ToolCallParser(NAMES)
    assert parser.feed(bare[:20], finished=False) == ("", [])  # held: it may become a call
    content, [call] = parser.feed(bare, finished=True)
    assert content == "" and call["function"]["name"] == "get_weather"
    other = '{"name": "Ann", "arguments": {}}'
    assert parse_tool_calls(other, NAMES) == (other, [])


def test_a_bare_call_after_a_whitespace_first_delta_streams_as_a_call_like_the_whole_output():
    text = '\n{"name": "get_weather", "arguments": {"city": "Paris"}}'
    parser, content, calls = ToolCallParser(NAMES), "", []
    for end in (1, 11, len(text)):
        delta, new = parser.feed(text[:end], finished=end == len(text))
        content, calls = content + delta, calls + new
    assert content == "" and [c["function"]["name"] for c in calls] == ["get_weather"]
    assert parse_tool_calls(text, NAMES)[1][0]["function"]["arguments"] == calls[0]["function"]["arguments"]


def test_a_cut_off_output_with_calls_finishes_length_and_keeps_the_unclosed_call_as_content():
    cut = f'{CALL}\n<tool_call>\n{{"name": "get_wea'
    for engine_reason, expected in (("length", "length"), ("stop", "tool_calls")):
        output = SimpleNamespace(
            text=cut, delta_text=cut, finish_reason=engine_reason, finished=True, logprobs=None, delta_logprobs=[]
        )
        whole = ChatFormat(None, False, NAMES).choice(SimpleNamespace(index=0, last=output))
        assert whole["finish_reason"] == expected and len(whole["message"]["tool_calls"]) == 1
        assert whole["message"]["content"].startswith("<tool_call>")
        chunk = ChatFormat(None, False, NAMES).chunk_choice(SimpleNamespace(index=0), output, first=True)
        assert chunk["finish_reason"] == expected and len(chunk["delta"]["tool_calls"]) == 1


def test_a_tagged_call_of_a_tool_the_request_does_not_have_stays_content():
    unknown = CALL.replace("get_weather", "rm_rf")
    assert parse_tool_calls(f"{unknown}\n{CALL}", NAMES)[1][0]["function"]["name"] == "get_weather"
    assert parse_tool_calls(unknown, NAMES) == (unknown, [])


def test_check_tools_takes_object_schemas_only():
    check_tools([{"function": {"name": "a"}}, {"function": {"name": "b", "parameters": {"type": "object"}}}])
    for i, parameters in ((0, {"type": "array"}), (1, {"type": "object", "properties": {"a": {"type": 5}}})):
        tools = [{"function": {"name": "a"}}] * i + [{"function": {"name": "x", "parameters": parameters}}]
        with pytest.raises(ValueError, match=rf"^tools\[{i}\]\.function\.parameters"):
            check_tools(tools)


def test_streamed_calls_send_no_empty_content_chunks():
    text = f"{CALL}\n{CALL}"
    formatter, chunks = ChatFormat(None, False, NAMES), []
    gen = SimpleNamespace(request_id="r", created=0, model_name="m", tier="standard")
    for end in range(0, len(text) + 1, 4):
        end = min(end + 1, len(text))
        output = SimpleNamespace(
            text=text[:end],
            delta_text=text[end - 4 : end],
            finish_reason="stop",
            finished=end == len(text),
            logprobs=None,
            delta_logprobs=[],
        )
        chunks.append(formatter.chunk(gen, SimpleNamespace(index=0), output))
    sent = [chunk["choices"][0] for chunk in chunks if chunk is not None]
    assert [c["delta"].get("content", "absent") for c in sent] == [None] + ["absent"] * (len(sent) - 1)
    assert sum(len(c["delta"].get("tool_calls", [])) for c in sent) == 2 and sent[-1]["finish_reason"] == "tool_calls"
    assert len(sent) <= 4  # the first, one per call, the last: held-back text sends nothing


def test_a_call_whose_arguments_do_not_validate_stays_content_tagged_or_bare():
    for arguments in ('{"town": "Paris"}', '{"city": 5}', '{"city": "Paris", "unit": "celsius"}', '"Paris"'):
        tagged = CALL.replace('{"city": "Paris"}', arguments)
        assert parse_tool_calls(tagged, NAMES) == (tagged, [])
        bare = f'{{"name": "get_weather", "arguments": {arguments}}}'
        assert parse_tool_calls(bare, NAMES) == (bare, [])
    assert len(parse_tool_calls(CALL, NAMES)[1]) == 1
    assert len(parse_tool_calls(CALL.replace('"Paris"', '"Paris", "any": 1'), {"get_weather": None})[1]) == 1


def test_check_tools_refuses_a_schema_that_arguments_cannot_be_checked_against():
    with pytest.raises(ValueError, match=r"^tools\[0\]\.function\.parameters: invalid JSON schema"):
        # The grammar library takes this pattern (Rust regex); Python's re, which jsonschema checks a bare call
        # with, cannot compile it.
        pattern = {"type": "object", "properties": {"a": {"type": "string", "pattern": r"\p{L}+"}}}
        check_tools([{"function": {"name": "x", "parameters": pattern}}])


@pytest.fixture(scope="module")
def qwen_grammars():
    tokenizer = Tokenizer.from_dir(resolve_model_dir("qwen2.5-coder-0.5b"))
    return tokenizer, GrammarCompiler(tokenizer, 151936)


@pytest.mark.parametrize("parallel", [True, False])
def test_auto_grammar_leaves_text_free_and_holds_an_opened_call_to_its_schema(qwen_grammars, parallel):
    tokenizer, grammars = qwen_grammars
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": CITY}}]
    grammar = grammars.bind(auto_grammar(tools, parallel)).grammar

    def accepted(text: str) -> bool:
        tokens = tokenizer.encode(text, add_special_tokens=False)
        matcher = grammar.matcher()
        return matcher.validate_tokens(tokens) == len(tokens)

    assert accepted('Any text at all, even {"name": "get_weather", "arguments": {"town": 5}}')
    assert accepted(f"Checking.\n{CALL}\n")
    assert accepted(f"{CALL}\n{CALL}") == parallel
    for wrong in ('{"town": "Paris"}', '{"city": 5}', '{"city": "Paris", "unit": "celsius"}'):
        assert not accepted(CALL.replace('{"city": "Paris"}', wrong))
    assert not accepted(CALL.replace("get_weather", "rm_rf"))


def test_a_block_may_hold_several_calls_a_line_each_and_a_bad_one_makes_it_all_content():
    paris, rome = (f'{{"name": "get_weather", "arguments": {{"city": "{city}"}}}}' for city in ("Paris", "Rome"))
    content, calls = parse_tool_calls(f"<tool_call>\n{paris}\n{rome}\n</tool_call>", NAMES)
    assert content is None and [json.loads(c["function"]["arguments"])["city"] for c in calls] == ["Paris", "Rome"]
    assert parse_tool_calls(f"{paris}\n{rome}", NAMES)[1][1]["function"]["arguments"] == '{"city": "Rome"}'
    broken = f'<tool_call>\n{paris}\n{{"name": "rm_rf", "arguments": {{}}}}\n</tool_call>'
    assert parse_tool_calls(broken, NAMES) == (broken, [])


def test_parallel_calls_may_share_a_block_and_one_call_may_not(qwen_grammars):
    tokenizer, grammars = qwen_grammars
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": CITY}}]
    shared = CALL.replace("\n</tool_call>", '\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>')
    for parallel in (True, False):
        for spec in (call_grammar(tools, None, parallel), auto_grammar(tools, parallel)):
            tokens = tokenizer.encode(shared, add_special_tokens=False)
            assert (grammars.bind(spec).grammar.matcher().validate_tokens(tokens) == len(tokens)) == parallel


def test_a_block_cut_by_max_tokens_keeps_its_whole_calls_and_the_rest_is_content():
    cut = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n{"name": "get_weather", "argu'
    content, calls = parse_tool_calls(cut, NAMES)
    assert [c["function"]["arguments"] for c in calls] == ['{"city": "Paris"}']
    assert content == '{"name": "get_weather", "argu'
