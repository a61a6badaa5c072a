"""Constraints compiled for one engine's tokenizer, with llguidance.

Why llguidance (1.9.1) over xgrammar (0.2.9), measured 2026-11-30 on the shared 2-core dev machine, one
matcher walking a 3-property JSON schema's output token by token: per-step mask median 9 us (SmolLM2, 49K
vocab) and 13 us (Qwen2.5, 152K), p90 46/74 us, against xgrammar's 2/8 us (p90 9/30 us); but compile 0.7 ms
against xgrammar's 3.3/14.5 ms. Either mask is far below a decode step (tens of ms at 32 streams), while compile
time is paid on the request's path for every new schema, so the faster compile wins. llguidance is also one Rust
wheel with no torch or TVM runtime to install (xgrammar needs apache-tvm-ffi), and its errors name the schema
keyword at fault ("Unimplemented keys: [\"not\"]").
"""

import functools
import json
import threading

import llguidance
import numpy as np

from carpool.engine.structured.spec import StructuredOutput

_FORMATS = {
    "json": "json_schema",
    "json_object": "json_schema",
    "regex": "regex",
    "choice": "choice",
    "grammar": "grammar",
}
# Bounds on what one constraint may cost to compile and per step (llguidance's defaults are ~5x these):
# a pathological schema fails at the door with a clear message instead of stalling the engine loop.
LIMITS = {
    "max_grammar_size": 100_000,
    "initial_lexer_fuel": 200_000,
    "step_lexer_fuel": 100_000,
    "step_max_items": 20_000,
    "max_lexer_states": 50_000,
}
COMPILE_CACHE_SIZE = 256
# JSON on one line, with Python's separators, unless a schema sets its own `x-guidance`: llguidance's default
# lets newlines and indentation run on, so a small model can spend max_tokens on whitespace (vLLM added
# `disable_any_whitespace` to xgrammar for the same), and each whitespace token is one not spent on the answer.
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class _ByteVocabulary:
    """One token per byte and an end token: enough to compile a constraint and see what it admits, with no model's
    tokenizer. llguidance's own tokenizer-free check (validate_grammar) passes what only a matcher rejects: an
    unknown `format` ("Unknown format: bogus") and a schema no value matches."""

    eos_token_id = 256
    bos_token_id = None
    tokens = (*(bytes([byte]) for byte in range(256)), b"<end>")
    special_token_ids = (256,)

    def __call__(self, text: str | bytes) -> list[int]:
        return list(text if isinstance(text, bytes) else text.encode())


@functools.cache
def _byte_tokenizer() -> llguidance.LLTokenizer:
    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_ByteVocabulary()))


@functools.lru_cache(maxsize=COMPILE_CACHE_SIZE)
def _schema_error(text: str) -> str:
    try:
        grammar = llguidance.grammar_from("json_schema", text)
    except ValueError as error:
        return str(error)
    matcher = llguidance.LLMatcher(_byte_tokenizer(), grammar, log_level=0, limits=llguidance.LLParserLimits(**LIMITS))
    if matcher.is_error():
        return matcher.get_error()
    return NO_JSON_VALUE if admits_nothing(matcher, [_ByteVocabulary.eos_token_id]) else ""


# What a schema that no JSON value matches is answered: llguidance compiles `{"$ref": "#"}` (a reference to itself
# with nothing to end it) to a grammar whose only move is the end, which would be an empty output, and "" is no JSON.
NO_JSON_VALUE = (
    "no JSON value matches this schema (it is unsatisfiable, or refers to itself with nothing to end the recursion, "
    'as {"$ref": "#"} does)'
)


def check_json_schema(schema: dict, source: str) -> None:
    """ValueError naming `source` unless llguidance can compile `schema` and some JSON value matches it: checked
    against a vocabulary of bytes, so it can run on the request's path before any grammar is built (cached; 0.5-1.3
    ms for a tool's pydantic schema on the shared 2-core machine, against 0.2-0.4 ms for validate_grammar alone)."""
    error = _schema_error(json.dumps(schema, sort_keys=True))
    if error:
        raise ValueError(f"{source}: invalid or unsupported JSON schema: {' '.join(error.split())}")


def admits_nothing(matcher: llguidance.LLMatcher, end_token_ids) -> bool:
    """Whether a fresh matcher allows only the end of the output, yet an empty output does not match."""
    fresh = matcher.deep_copy()
    allowed = np.unpackbits(np.frombuffer(fresh.compute_bitmask(), dtype=np.uint8), bitorder="little")
    allowed[list(end_token_ids)] = 0
    return not allowed.any() and not fresh.is_accepting()


class CompiledGrammar:
    """A constraint ready to run: a pristine matcher that each sequence copies (n choices share one compile)."""

    def __init__(self, template: llguidance.LLMatcher):
        self._template = template

    def matcher(self) -> llguidance.LLMatcher:
        return self._template.deep_copy()


class GrammarCompiler:
    """Compiles constraints for one tokenizer, caching the last COMPILE_CACHE_SIZE by their text."""

    def __init__(self, tokenizer, vocab_size: int):
        self._tokenizer, self._vocab_size = tokenizer, vocab_size
        self._lock = threading.Lock()
        self.compile = functools.lru_cache(maxsize=COMPILE_CACHE_SIZE)(self._compile)

    @functools.cached_property
    def ll_tokenizer(self) -> llguidance.LLTokenizer:
        # Built on first use (0.2 s for SmolLM2, 0.7 s for Qwen2.5): servers that never see a constraint pay nothing.
        # Every end-of-turn token counts as EOS, so the grammar allows any of them once the output is complete.
        with self._lock:
            return llguidance.LLTokenizer(
                self._tokenizer.to_json(), n_vocab=self._vocab_size, eos_token=sorted(self._tokenizer.stop_token_ids)
            )

    def bind(self, spec: StructuredOutput | None) -> StructuredOutput | None:
        """`spec` with its compiled grammar; ValueError naming spec.source when it does not compile."""
        if spec is None:
            return None
        if not isinstance(spec, StructuredOutput):
            raise ValueError("structured must be a StructuredOutput")
        return StructuredOutput(spec.kind, spec.value, spec.source, self.compile(spec.kind, spec.text, spec.source))

    def _compile(self, kind: str, text: str, source: str) -> CompiledGrammar:
        if _FORMATS[kind] == "json_schema":
            text = _with_layout(text)
        try:
            grammar = llguidance.grammar_from(_FORMATS[kind], text)
        except ValueError as error:
            raise ValueError(f"{source}: {error}") from None
        matcher = llguidance.LLMatcher(
            self.ll_tokenizer, grammar, log_level=0, limits=llguidance.LLParserLimits(**LIMITS)
        )
        if matcher.is_error():
            error = " ".join(matcher.get_error().split())  # one line: regex errors draw a caret on several
            raise ValueError(f"{source}: invalid or unsupported {kind} constraint: {error}")
        if admits_nothing(matcher, self._tokenizer.stop_token_ids):
            what = NO_JSON_VALUE if _FORMATS[kind] == "json_schema" else f"no output matches this {kind} constraint"
            raise ValueError(f"{source}: {what}")
        return CompiledGrammar(matcher)


def _with_layout(schema_text: str) -> str:
    """The schema with JSON_LAYOUT, when it is a JSON object that names no layout of its own."""
    try:
        schema = json.loads(schema_text)
    except ValueError:
        return schema_text  # llguidance's own error names what is wrong with it
    if not isinstance(schema, dict) or "x-guidance" in schema:
        return schema_text
    return json.dumps(schema | {"x-guidance": JSON_LAYOUT})
