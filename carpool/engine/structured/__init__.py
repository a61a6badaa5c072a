"""Structured outputs: constrained decoding with a grammar per request (see grammars.py for the library choice)."""

from carpool.engine.structured.spec import KINDS, MAX_SPEC_CHARS, StructuredOutput

__all__ = ["KINDS", "MAX_SPEC_CHARS", "StructuredOutput"]
