"""Fuzz the endpoints from the server's own OpenAPI schema: schema-valid bodies, the same with one field
replaced by arbitrary JSON, arbitrary JSON, and raw bytes. No input may get a 5xx or take the server down."""

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

ENDPOINTS = {
    "/v1/chat/completions": "ChatCompletionRequest",
    "/v1/completions": "CompletionRequest",
    "/tokenize": "TokenizeRequest",
    "/detokenize": "DetokenizeRequest",
    "/v1/responses": "ResponsesRequest",
}
EXPECTED = {200, 400, 404, 413, 429}
MAX_LIST = 3
# Broken values may hold any character, lone UTF-16 surrogates included: JSON escapes them ("\\ud800"), and they
# must be a 400. (`.map(str)` keeps hypothesis from merging the two into one alphabet that never draws a surrogate.)
CHARACTERS = st.characters() | st.characters(categories=["Cs"]).map(str)

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(CHARACTERS, max_size=20),
    lambda children: (
        st.lists(children, max_size=MAX_LIST) | st.dictionaries(st.text(max_size=8), children, max_size=MAX_LIST)
    ),
    max_leaves=8,
)


def from_schema(schema: dict, schemas: dict) -> st.SearchStrategy:
    """A strategy for the JSON-schema subset pydantic emits."""
    if "$ref" in schema:
        name = schema["$ref"].rsplit("/", 1)[-1]
        return st.deferred(lambda: from_schema(schemas[name], schemas))
    if "const" in schema:
        return st.just(schema["const"])
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    if "anyOf" in schema or "oneOf" in schema:
        return st.one_of([from_schema(option, schemas) for option in schema.get("anyOf", schema.get("oneOf"))])
    kind = schema.get("type")
    if kind == "object":
        properties = {k: from_schema(v, schemas) for k, v in schema.get("properties", {}).items()}
        required = set(schema.get("required", []))
        return st.fixed_dictionaries(
            {k: v for k, v in properties.items() if k in required},
            optional={k: v for k, v in properties.items() if k not in required},
        )
    if kind == "array":
        low = schema.get("minItems", 0)
        return st.lists(
            from_schema(schema.get("items", {}), schemas),
            min_size=low,
            max_size=max(low, min(schema.get("maxItems", MAX_LIST), MAX_LIST)),
        )
    if kind == "string":
        return st.text(min_size=schema.get("minLength", 0), max_size=40)
    if kind == "integer":
        low = schema.get("minimum", schema["exclusiveMinimum"] + 1 if "exclusiveMinimum" in schema else None)
        return st.integers(min_value=low, max_value=schema.get("maximum"))
    if kind == "number":
        return st.floats(
            min_value=schema.get("minimum", schema.get("exclusiveMinimum")),
            max_value=schema.get("maximum"),
            exclude_min="exclusiveMinimum" in schema,
            allow_nan=False,
            allow_infinity=False,
        )
    if kind == "boolean":
        return st.booleans()
    if kind == "null":
        return st.none()
    return json_values


def cheap(body, model: str, use_model: bool, path: str):
    """Valid examples should cost a few tokens: cap lengths and choices, and mostly name the served model."""
    if not isinstance(body, dict):
        return body
    limits = ("max_tokens", "max_completion_tokens", "max_output_tokens")
    for key, cap in [(limit, 2) for limit in limits] + [("n", 2), ("best_of", 2)]:
        if type(body.get(key)) is int and body[key] > cap:
            body[key] = cap
    if all(body.get(limit) is None for limit in limits):  # chat's default is the rest of the context window
        body["max_output_tokens" if path == "/v1/responses" else "max_tokens"] = 2
    if use_model and "model" in body:
        body["model"] = model
    return body


def stream_ended(path: str, text: str) -> bool:
    """A stream ends with [DONE]; the Responses API's with its finished response."""
    last = text.rstrip().rsplit("\n", 1)[-1]
    if path == "/v1/responses":
        return json.loads(last.removeprefix("data: "))["type"] in ("response.completed", "response.incomplete")
    return last == "data: [DONE]"


@pytest.fixture(scope="module")
def openapi(server):
    with server.http() as http:  # with the key: the schema is closed to others where keys are required
        return http.get("/openapi.json").json()


@pytest.mark.parametrize("path", list(ENDPOINTS))
def test_no_input_gets_a_server_error(server, model, openapi, path):
    schemas = openapi["components"]["schemas"]
    valid = from_schema(schemas[ENDPOINTS[path]], schemas)
    field_names = st.sampled_from(sorted(schemas[ENDPOINTS[path]]["properties"])) | st.text(max_size=12)
    one_field_broken = st.builds(lambda body, key, value: {**body, key: value}, valid, field_names, json_values)
    bodies = st.one_of(valid, one_field_broken, json_values)

    with server.http() as http:

        @settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
        @given(body=bodies | st.binary(max_size=64), use_model=st.booleans())
        def check(body, use_model):
            body = cheap(body, model, use_model, path)
            content = body if isinstance(body, bytes) else json.dumps(body).encode()
            response = http.post(path, content=content, headers={"Content-Type": "application/json"})
            assert response.status_code in EXPECTED, (body, response.status_code, response.text)
            if response.status_code != 200:
                assert set(response.json()["error"]) == {"message", "type", "param", "code"}
            elif isinstance(body, dict) and body.get("stream") is True:
                assert stream_ended(path, response.text), response.text

        check()
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}
