"""Schemas as clients write them (pydantic's `$defs`, draft-7's `definitions`, recursion, unions of objects, enums,
consts, formats) constrain tool calls under every tool_choice, parallel or not, and a response_format; what the
engine cannot enforce, or what no JSON value matches, is refused naming it. Walked with Qwen's tokenizer: no
weights."""

import json
import re
from enum import Enum
from typing import Literal

import pytest
from pydantic import BaseModel, Field

from carpool.engine.structured import StructuredOutput
from carpool.engine.structured.grammars import NO_JSON_VALUE, GrammarCompiler, check_json_schema
from carpool.engine.structured.schemas import embedded
from carpool.models.loader import resolve_model_dir
from carpool.models.tokenizer import Tokenizer
from carpool.server.tool_calls import auto_grammar, call_grammar, check_tools


class Unit(str, Enum):
    celsius = "celsius"
    fahrenheit = "fahrenheit"


class Place(BaseModel):
    city: str = Field(max_length=20)
    unit: Unit


class Forecast(BaseModel):
    places: list[Place]
    note: str | None = None


class Tree(BaseModel):
    name: str
    kids: list["Tree"] = []


class Cat(BaseModel):
    kind: Literal["cat"]
    lives: int


class Dog(BaseModel):
    kind: Literal["dog"]
    good: bool


class Pet(BaseModel):
    pet: Cat | Dog = Field(discriminator="kind")  # pydantic writes a oneOf of two $refs


def tool(name: str, parameters: dict) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


# Two tools whose `$defs` both hold a `P`, of different shapes: each call must meet its own.
P_STRING = {
    "type": "object",
    "properties": {"p": {"$ref": "#/$defs/P"}},
    "required": ["p"],
    "$defs": {"P": {"type": "string"}},
}
P_NUMBER = {
    "type": "object",
    "properties": {"p": {"$ref": "#/$defs/P"}},
    "required": ["p"],
    "$defs": {"P": {"type": "integer"}},
}
DRAFT_7 = {
    "$schema": "http://json-schema.org/draft-07/schema#",
    "type": "object",
    "properties": {"when": {"$ref": "#/definitions/When"}, "again": {"$ref": "#/properties/when"}},
    "required": ["when"],
    "additionalProperties": False,
    "definitions": {"When": {"type": "string", "format": "date"}},
}
TOOLS = [
    tool("forecast", Forecast.model_json_schema()),
    tool("tree", Tree.model_json_schema()),
    tool("pet", Pet.model_json_schema()),
    tool("text", P_STRING),
    tool("number", P_NUMBER),
    tool("day", DRAFT_7),
    tool(
        "mode", {"type": "object", "properties": {"v": {"const": 1}, "m": {"enum": ["a", "b"]}}, "required": ["v", "m"]}
    ),
]


def call(name: str, arguments: dict) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {json.dumps(arguments)}}}\n</tool_call>'


GOOD = [
    call("forecast", {"places": [{"city": "Paris", "unit": "celsius"}], "note": None}),
    call("forecast", {"places": [], "note": "dry"}),
    call("tree", {"name": "a", "kids": [{"name": "b", "kids": [{"name": "c", "kids": []}]}]}),
    call("pet", {"pet": {"kind": "dog", "good": True}}),
    call("text", {"p": "x"}),
    call("number", {"p": 5}),
    call("day", {"when": "2026-12-06", "again": "2026-12-07"}),
    call("mode", {"v": 1, "m": "b"}),
]
BAD = [
    call("forecast", {"places": [{"city": "Paris", "unit": "kelvin"}]}),  # not in the enum
    call("forecast", {"places": [{"city": "Paris"}]}),  # a required field of the nested model
    call("tree", {"name": "a", "kids": [{"name": 5}]}),  # deep in the recursion
    call("pet", {"pet": {"kind": "cat", "good": True}}),  # a cat is not a dog
    call("text", {"p": 5}),  # `text`'s P is a string ...
    call("number", {"p": "x"}),  # ... and `number`'s an integer
    call("day", {"when": "yesterday"}),  # not a date
    call("day", {"when": "2026-12-06", "other": 1}),  # additionalProperties: false
    call("mode", {"v": 2, "m": "a"}),  # const
]


@pytest.fixture(scope="module")
def qwen():
    tokenizer = Tokenizer.from_dir(resolve_model_dir("qwen2.5-coder-0.5b"))
    return tokenizer, GrammarCompiler(tokenizer, 151936)


def accepts(qwen, spec: StructuredOutput, text: str) -> bool:
    tokenizer, grammars = qwen
    tokens = tokenizer.encode(text, add_special_tokens=False)
    matcher = grammars.bind(spec).grammar.matcher()
    return matcher.validate_tokens(tokens) == len(tokens) and matcher.try_consume_tokens(tokens) == len(tokens)


def test_references_move_with_the_schema_and_data_stays_as_it_is():
    schema = {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "properties": {"a": {"$ref": "#/$defs/A"}, "self": {"$ref": "#"}, "b": {"$ref": "#anchor"}},
        "enum": [{"$ref": "#/not/a/reference"}],
        "$defs": {"A": {"items": [{"$ref": "#/properties/a"}]}},
    }
    assert embedded(schema, "/$defs/t", "tools") == {
        "properties": {"a": {"$ref": "#/$defs/t/$defs/A"}, "self": {"$ref": "#/$defs/t"}, "b": {"$ref": "#anchor"}},
        "enum": [{"$ref": "#/not/a/reference"}],
        "$defs": {"A": {"items": [{"$ref": "#/$defs/t/properties/a"}]}},
    }
    with pytest.raises(ValueError, match=r"^tools: \$ref 'https://x.io/s.json' is not a reference within"):
        embedded({"$ref": "https://x.io/s.json"}, "/$defs/t", "tools")


def test_every_schema_checks_alone():
    check_tools(TOOLS)


@pytest.mark.parametrize("parallel", [True, False])
def test_required_calls_meet_their_own_tools_schema(qwen, parallel):
    grammar = call_grammar(TOOLS, None, parallel)
    for good in GOOD:
        assert accepts(qwen, grammar, good), good
    for bad in BAD:
        assert not accepts(qwen, grammar, bad), bad
    assert accepts(qwen, grammar, f"{GOOD[0]}\n{GOOD[2]}") == parallel


def test_a_named_call_meets_its_schema(qwen):
    grammar = call_grammar(TOOLS, "tree", False)
    assert accepts(qwen, grammar, GOOD[2])
    assert not accepts(qwen, grammar, BAD[2]) and not accepts(qwen, grammar, GOOD[0])


@pytest.mark.parametrize("parallel", [True, False])
def test_auto_holds_each_opened_call_to_its_schema(qwen, parallel):
    grammar = auto_grammar(TOOLS, parallel)
    for good in GOOD:
        assert accepts(qwen, grammar, f"Sure.\n{good}"), good
    for bad in BAD:
        assert not accepts(qwen, grammar, f"Sure.\n{bad}"), bad
    assert accepts(qwen, grammar, f"{GOOD[3]}\n{GOOD[4]}") == parallel


@pytest.mark.parametrize(
    "schema, words",
    [
        ({"type": "object", "properties": {"a": {"type": "array", "uniqueItems": True}}}, "uniqueItems"),
        ({"type": "object", "properties": {"a": {"not": {"type": "string"}}}}, "not"),
        ({"type": "object", "propertyNames": {"maxLength": 3}}, "propertyNames"),
        ({"type": "object", "properties": {"a": {"type": "string", "format": "color"}}}, "Unknown format: color"),
        ({"$ref": "#"}, "no JSON value matches"),
        ({"type": "object", "properties": {"a": {"$ref": "https://x.io/s.json"}}}, "https://x.io/s.json"),
    ],
)
def test_what_the_engine_cannot_enforce_is_refused_naming_it(schema, words):
    with pytest.raises(ValueError, match=rf"^tools\[0\]\.function\.parameters: .*{words}"):
        check_tools([{"function": {"name": "x", "parameters": schema}}])
    with pytest.raises(ValueError, match=rf"^response_format: .*{words}"):
        check_json_schema(schema, "response_format")


def test_a_schema_no_value_matches_is_refused_not_answered_empty(qwen):
    _, grammars = qwen
    for schema in ({"$ref": "#"}, {"$ref": "#/$defs/A", "$defs": {"A": {"$ref": "#/$defs/A"}}}):
        with pytest.raises(ValueError, match=re.escape(f"response_format: {NO_JSON_VALUE}")):
            grammars.bind(StructuredOutput("json", schema, "response_format"))
    # A grammar whose only output is empty still compiles: it asks for exactly that.
    assert grammars.bind(StructuredOutput("regex", "", "guided_regex")).grammar is not None
