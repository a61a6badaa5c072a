"""JSON constraints compile to one-line JSON with Python's separators (whitespace cannot run on to max_tokens),
unless the schema names its own layout, and write properties in the schema's order. Walked with SmolLM2's
tokenizer: no weights."""

import pytest

from carpool.engine.structured import StructuredOutput
from carpool.engine.structured.grammars import GrammarCompiler
from carpool.models.loader import resolve_model_dir
from carpool.models.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def compiler():
    tokenizer = Tokenizer.from_dir(resolve_model_dir("smollm2-135m"))
    return tokenizer, GrammarCompiler(tokenizer, 49152)


def accepts(compiler, spec: StructuredOutput, text: str) -> bool:
    tokenizer, grammars = compiler
    tokens = tokenizer.encode(text, add_special_tokens=False)
    return grammars.bind(spec).grammar.matcher().validate_tokens(tokens) == len(tokens)


@pytest.mark.parametrize(
    "spec",
    [StructuredOutput("json_object"), StructuredOutput("json", {"type": "object", "properties": {"a": {}, "b": {}}})],
)
def test_json_is_one_line_with_pythons_separators(compiler, spec):
    assert accepts(compiler, spec, '{"a": 1, "b": [1, 2]}')
    for spread in ('{\n  "a": 1\n}', '{ "a": 1}', '{"a":1}', '{"a": 1,  "b": 2}'):
        assert not accepts(compiler, spec, spread), spread


def test_a_schema_with_its_own_layout_keeps_it(compiler):
    flexible = StructuredOutput("json", {"type": "object", "x-guidance": {"whitespace_flexible": True}})
    assert accepts(compiler, flexible, '{\n  "a": 1\n}')


def test_properties_come_in_the_schemas_order(compiler):
    schema = {
        "type": "object",
        "required": ["name", "age"],
        "additionalProperties": False,
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    }
    assert accepts(compiler, StructuredOutput("json", schema), '{"name": "Al", "age": 3}')
    assert not accepts(compiler, StructuredOutput("json", schema), '{"age": 3, "name": "Al"}')
