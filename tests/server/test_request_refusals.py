"""What OpenAI refuses, refused the same way (duplicate tool names, null content on a user message,
stream_options without stream), schemas no JSON value matches or with a keyword the engine cannot enforce
refused naming it, and /openapi.json telling the truth about statuses and methods. The official SDK where it
can send the request, httpx where it cannot."""

import openai
import pytest

from carpool.engine.structured.grammars import NO_JSON_VALUE

HELLO = [{"role": "user", "content": "Hello"}]
CITY = {"type": "object", "properties": {"city": {"type": "string"}}}


def refused(client, **body) -> openai.BadRequestError:
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=body.pop("model", None) or "unused", **body)
    return caught.value


def test_duplicate_tool_names(client, model):
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": CITY}}
    error = refused(client, model=model, messages=HELLO, tools=[tool, tool], max_tokens=1)
    assert error.body["param"] == "tools"
    assert error.body["message"] == (
        "tools: function names must be unique: 'get_weather' is the name of tools[0] and tools[1]"
    )


@pytest.mark.parametrize("role", ["user", "system", "tool"])
def test_null_content_is_refused_except_on_an_assistant_turn(server, model, role):
    with server.http() as http:
        answer = http.post(
            "/v1/chat/completions",
            json={"model": model, "messages": [{"role": role, "content": None}], "max_tokens": 1},
        )
        assert answer.status_code == 400
        assert answer.json()["error"]["message"] == (
            "messages[0].content: Invalid value for 'content': expected a string, got null."
        )
        assistant = [*HELLO, {"role": "assistant", "content": None}, {"role": "user", "content": "Hi?"}]
        assert http.post(
            "/v1/chat/completions", json={"model": model, "messages": assistant, "max_tokens": 1}
        ).is_success


def test_stream_options_need_stream(client, model):
    for stream in (None, False):
        error = refused(
            client, model=model, messages=HELLO, max_tokens=1, stream_options={"include_usage": True}, stream=stream
        )
        assert error.body["param"] == "stream_options"
        assert error.body["message"].endswith(
            "The 'stream_options' parameter is only allowed when 'stream' is enabled."
        )
    chunks = list(
        client.chat.completions.create(
            model=model, messages=HELLO, max_tokens=1, stream=True, stream_options={"include_usage": True}
        )
    )
    assert chunks[-1].usage is not None


@pytest.mark.parametrize(
    "schema, words",
    [
        ({"$ref": "#"}, NO_JSON_VALUE),
        ({"type": "object", "properties": {"a": {"type": "string", "format": "colour"}}}, "Unknown format: colour"),
        ({"type": "array", "uniqueItems": True}, "uniqueItems"),
    ],
)
def test_a_schema_the_engine_cannot_keep_is_a_400_naming_it_not_an_empty_answer(client, model, schema, words):
    """`{"$ref": "#"}` was answered "" with finish_reason "stop" before issue 48."""
    response_format = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}
    error = refused(client, model=model, messages=HELLO, max_tokens=5, response_format=response_format)
    assert error.body["param"] == "response_format" and words in error.body["message"]


def test_openapi_documents_each_routes_statuses(server):
    with server.http() as http:
        paths = http.get("/openapi.json").json()["paths"]
    chat = paths["/v1/chat/completions"]["post"]["responses"]
    assert {"200", "400", "401", "403", "404", "413", "429", "499", "500", "503"} <= set(chat)
    assert chat["404"]["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/Error"}
    assert "401" not in paths["/health"]["get"]["responses"] and "503" in paths["/health"]["get"]["responses"]
    assert "text/plain" in paths["/metrics"]["get"]["responses"]["200"]["content"]
    assert {"404", "409"} <= set(paths["/v1/files/{file_id}"]["delete"]["responses"])


def test_a_405_allows_every_method_of_the_path(server):
    with server.http() as http:
        for path, methods in (("/v1/files", {"GET", "POST"}), ("/v1/files/file-x", {"GET", "DELETE"})):
            answer = http.request("PATCH", path)
            assert answer.status_code == 405
            assert methods <= set(answer.headers["allow"].split(", ")), answer.headers
