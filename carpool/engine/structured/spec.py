"""What a request's output must match: a JSON schema, any JSON object, a regex, one of a list of strings, or a
grammar (Lark, or llama.cpp's GBNF). Plain data, checked here; compiled for a tokenizer by `grammars`."""

import json
from dataclasses import dataclass, field
from typing import Any

KINDS = ("json", "json_object", "regex", "choice", "grammar")
# The largest schema, regex or grammar text a request may send: compile time and memory grow with it, and
# real extraction schemas are a few KB (the OpenAI strict mode's own cap is 100 properties).
MAX_SPEC_CHARS = 64 * 1024
MAX_CHOICE_STRINGS = 1024


@dataclass(frozen=True)
class StructuredOutput:
    """`source` is the request field it came from (`response_format`, `guided_json`, `tools`...): errors name it.
    `grammar` is filled at the engine's door (the compiled form for that engine's tokenizer), never by callers."""

    kind: str
    value: Any = None
    source: str = "structured_outputs"
    grammar: Any = field(default=None, compare=False, repr=False)

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"{self.source}: kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        checks = {
            "json": (dict, str),
            "json_object": (type(None),),
            "regex": (str,),
            "choice": (list,),
            "grammar": (str,),
        }
        if not isinstance(self.value, checks[self.kind]) or isinstance(self.value, bool):
            raise ValueError(
                f"{self.source}: a {self.kind} constraint takes a "
                f"{' or '.join(t.__name__ for t in checks[self.kind])}, got {type(self.value).__name__}"
            )
        if self.kind == "choice" and (
            not self.value
            or len(self.value) > MAX_CHOICE_STRINGS
            or not all(isinstance(s, str) and s for s in self.value)
        ):
            raise ValueError(f"{self.source}: choice must be 1 to {MAX_CHOICE_STRINGS} non-empty strings")
        size = len(self.text)
        if size > MAX_SPEC_CHARS:
            raise ValueError(
                f"{self.source}: the {self.kind} constraint is {size} characters; at most {MAX_SPEC_CHARS} are accepted"
            )

    @property
    def constraint_kind(self) -> str:
        """What the ledger calls it: json_schema | json_object | regex | choice | grammar, or tools for the grammar
        of a request's tools (tool_choice "auto", "required" or a named function)."""
        return "tools" if self.source == "tools" else "json_schema" if self.kind == "json" else self.kind

    @property
    def text(self) -> str:
        """The constraint as text, the key its compiled grammar is cached under. A schema keeps its key order: the
        grammar writes properties in the order the schema lists them (as OpenAI's strict mode does), and a client
        may rely on it (a `reasoning` field before the `answer`)."""
        if self.kind == "json_object":
            return '{"type": "object"}'
        if isinstance(self.value, str):
            return self.value
        return json.dumps(self.value)
