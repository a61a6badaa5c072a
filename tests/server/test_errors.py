"""Every 4xx the API promises, with OpenAI's error body, and the SDK's matching exception classes."""

import openai
import pytest

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MESSAGES = [{"role": "user", "content": "Hi"}]
MISSING = object()


def error_of(response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


@pytest.fixture(scope="module")
def http(server):
    with server.http() as client:
        yield client


def test_missing_or_wrong_api_key_is_401(server, model):
    for key in ("sk-wrong", None):
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        with server.http() as http:
            http.headers.clear()
            response = http.post(CHAT, json={"model": model, "messages": MESSAGES}, headers=headers)
        assert error_of(response, 401)["type"] == "authentication_error"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server.url}/v1", api_key="sk-wrong", max_retries=0).models.list()


def test_health_and_metrics_need_no_key(server):
    import httpx

    assert httpx.get(f"{server.url}/health").status_code == 200
    assert httpx.get(f"{server.url}/metrics").status_code == 200


def test_malformed_json_is_400(http):
    response = http.post(CHAT, content=b'{"messages": [', headers={"Content-Type": "application/json"})
    assert "JSON" in error_of(response, 400)["message"]


def test_body_not_an_object_is_400(http):
    assert error_of(http.post(CHAT, json=[1, 2]), 400)["param"] is None


@pytest.mark.parametrize(
    ("path", "fields", "param"),
    [
        (CHAT, {"temperature": "hot"}, "temperature"),
        (CHAT, {"max_tokens": "16"}, "max_tokens"),
        (CHAT, {"n": 1.5}, "n"),
        (CHAT, {"stream": "yes"}, "stream"),
        (CHAT, {"stop": [1, 2]}, "stop"),
        (CHAT, {"messages": [{"role": "user", "content": 42}]}, "messages"),
        (CHAT, {"messages": [{"role": "robot", "content": "hi"}]}, "messages"),
        (CHAT, {"messages": []}, "messages"),
        (CHAT, {"messages": None}, "messages"),
        (CHAT, {"service_tier": "turbo"}, "service_tier"),
        (CHAT, {"temperature": 2.5}, "temperature"),
        (CHAT, {"top_p": 0}, "top_p"),
        (CHAT, {"n": 0}, "n"),
        (CHAT, {"max_tokens": 0}, "max_tokens"),
        (CHAT, {"max_completion_tokens": -3}, "max_completion_tokens"),
        (CHAT, {"top_logprobs": 21, "logprobs": True}, "top_logprobs"),
        (CHAT, {"top_logprobs": 2}, "top_logprobs"),
        (CHAT, {"min_p": 1.5}, "min_p"),
        (CHAT, {"top_k": -2}, "top_k"),
        (CHAT, {"priority": 7}, "priority"),
        (CHAT, {"priority": 0, "service_tier": "flex"}, "priority"),
        (CHAT, {"stop": ["a", ""]}, "stop"),
        (CHAT, {"stop": ["a", "b", "c", "d", "e"]}, "stop"),
        (COMPLETIONS, {"prompt": ""}, "prompt"),
        (COMPLETIONS, {"prompt": []}, "prompt"),
        (COMPLETIONS, {"prompt": [1, "a"]}, "prompt"),
        (COMPLETIONS, {"prompt": [10**9]}, "prompt"),
        (COMPLETIONS, {"prompt": "Hi", "logprobs": 99}, "logprobs"),
        (COMPLETIONS, {"prompt": ["a", "b"], "n": 100}, "n"),
        (COMPLETIONS, {"prompt": MISSING}, "prompt"),
    ],
)
def test_bad_parameter_is_400_naming_it(http, model, path, fields, param):
    body = {"model": model, "messages": MESSAGES} if path == CHAT else {"model": model, "prompt": "Hi"}
    body.update(fields)
    body = {k: v for k, v in body.items() if v is not MISSING}
    error = error_of(http.post(path, json=body), 400)
    assert error["param"] == param, error
    assert error["type"] == "invalid_request_error"


SURROGATE = '"caf\\udce9"'  # JSON text for a lone low surrogate: valid JSON, not valid Unicode
SAY_HI = '{"role": "user", "content": "hi"}'


def client_address(response) -> tuple:
    return response.extensions["network_stream"].get_extra_info("client_addr")


@pytest.mark.parametrize(
    ("path", "body", "field"),
    [
        (CHAT, '{"messages": [{"role": "user", "content": %s}]}', "messages[0].content"),
        (
            CHAT,
            '{"messages": [{"role": "user", "content": [{"type": "text", "text": %s}]}]}',
            "messages[0].content[0].text",
        ),
        (CHAT, '{"messages": [{"role": "user", "content": "hi", "name": %s}]}', "messages[0].name"),
        (CHAT, '{"messages": [' + SAY_HI + '], "stop": ["ok", %s]}', "stop[1]"),
        (CHAT, '{"messages": [' + SAY_HI + '], "user": %s}', "user"),
        (CHAT, '{"messages": [' + SAY_HI + '], "bad_words": [%s]}', "bad_words[0]"),
        (COMPLETIONS, '{"prompt": %s}', "prompt"),
        (COMPLETIONS, '{"prompt": ["fine", %s]}', "prompt[1]"),
        (COMPLETIONS, '{"prompt": "hi", "stop": %s}', "stop"),
        ("/tokenize", '{"prompt": %s}', "prompt"),
        ("/tokenize", '{"messages": [{"role": "user", "content": %s}]}', "messages[0].content"),
    ],
)
def test_lone_surrogate_is_400_naming_the_field_and_keeps_the_connection(http, path, body, field):
    response = http.post(path, content=(body % SURROGATE).encode(), headers={"Content-Type": "application/json"})
    error = error_of(response, 400)
    assert error["message"].startswith(f"{field}: ") and "surrogate" in error["message"], error
    assert error["param"] == field.split("[")[0].split(".")[0]
    again = http.post("/tokenize", json={"prompt": "still here"})
    assert again.status_code == 200 and client_address(again) == client_address(response)  # same connection


def test_lone_surrogate_in_a_field_name_is_400(http):
    body = ('{"messages": [' + SAY_HI + "], %s: 1}") % SURROGATE
    response = http.post(CHAT, content=body.encode(), headers={"Content-Type": "application/json"})
    assert "unicode" in error_of(response, 400)["message"]
    assert http.post("/tokenize", json={"prompt": "still here"}).status_code == 200


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as raised:
        client.chat.completions.create(model="gpt-17", messages=MESSAGES, max_tokens=1)
    assert raised.value.body["code"] == "model_not_found" and raised.value.body["param"] == "model"


def test_prompt_plus_max_tokens_beyond_the_context_window(client, model):
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=10**6)
    assert raised.value.body["code"] == "context_length_exceeded"
    assert raised.value.body["param"] == "max_tokens"
    with pytest.raises(openai.BadRequestError) as raised:
        client.completions.create(model=model, prompt=[42] * 9000, max_tokens=1)
    assert raised.value.body["code"] == "context_length_exceeded"
    assert raised.value.body["param"] == "prompt"


def test_body_over_the_size_limit_is_413(http, model):
    huge = {"model": model, "prompt": "a" * (5 * 2**20)}
    assert error_of(http.post(COMPLETIONS, json=huge), 413)["type"] == "invalid_request_error"


def test_chunked_body_over_the_size_limit_is_413(http, model):
    def chunks():
        yield b'{"prompt": "'
        for _ in range(5):
            yield b"a" * 2**20
        yield b'"}'

    response = http.post(COMPLETIONS, content=chunks(), headers={"Content-Type": "application/json"})
    error_of(response, 413)


def test_unknown_route_and_method(http):
    error_of(http.get("/v1/nothing-here"), 404)
    error_of(http.get(CHAT), 405)


def test_tokenizer_endpoints_reject_bad_input(http):
    assert error_of(http.post("/tokenize", json={}), 400)["param"] == "prompt"
    assert error_of(http.post("/tokenize", json={"prompt": "a", "messages": MESSAGES}), 400)["param"] == "prompt"
    assert error_of(http.post("/detokenize", json={"tokens": [-1]}), 400)["param"] == "tokens"
    assert error_of(http.post("/detokenize", json={"tokens": "abc"}), 400)["param"] == "tokens"
