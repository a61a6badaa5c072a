"""JSON schemas as clients write them, placed inside a larger schema.

pydantic writes a nested model as `{"$ref": "#/$defs/Inner"}` beside a root `$defs`; draft-7 tools write
`#/definitions/...`; a recursive model refers to the root itself (`"#"`). A `$ref` is a JSON pointer from the root
of the document it sits in, so a schema placed at some pointer of a larger one (a tool's parameters under the
call's `arguments`) must have every local `$ref` moved there too, or llguidance answers "Pointer '/$defs/P' does
not exist". Each embedded schema keeps its own `$defs` where they are: two tools that both define `P` cannot clash.
"""

# Keywords whose values are data, not schemas: an `enum` of objects may hold a "$ref" key that is no reference.
_DATA_KEYWORDS = frozenset({"enum", "const", "default", "examples"})
# Keywords that only mean something at a document's root.
_ROOT_KEYWORDS = ("$schema", "$id")


def embedded(schema: dict, pointer: str, source: str) -> dict:
    """`schema` as it reads placed at `pointer` (such as "/$defs/get_weather") of a larger document: each local
    `$ref` ("#", "#/$defs/P", "#/properties/a") points where its target now is. ValueError naming `source` for a
    reference that leaves the schema (a URL, another file): the engine has nothing to fetch it from."""
    moved = _moved(schema, pointer, source)
    return {key: value for key, value in moved.items() if key not in _ROOT_KEYWORDS}


def _moved(node, pointer: str, source: str):
    if isinstance(node, list):
        return [_moved(item, pointer, source) for item in node]
    if not isinstance(node, dict):
        return node
    moved = {}
    for key, value in node.items():
        if key in _DATA_KEYWORDS:
            moved[key] = value
        elif key == "$ref" and isinstance(value, str):
            moved[key] = _moved_ref(value, pointer, source)
        else:
            moved[key] = _moved(value, pointer, source)
    return moved


def _moved_ref(ref: str, pointer: str, source: str) -> str:
    if not ref.startswith("#"):
        raise ValueError(
            f"{source}: $ref {ref!r} is not a reference within the schema (#/$defs/...); put the schema it names "
            "under $defs"
        )
    fragment = ref[1:]
    if fragment and not fragment.startswith("/"):
        return ref  # an $anchor's name: anchors are found wherever they are in the document
    return f"#{pointer}{fragment}"
