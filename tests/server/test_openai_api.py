"""The official `openai` SDK against a real server: what its users call, unchanged."""

import json

import pytest

HELLO = [{"role": "user", "content": "Count from 1 to 20, separated by commas."}]


def test_models_lists_the_served_model(client, model, server):
    assert [m.id for m in client.models.list().data] == [model]
    assert client.models.retrieve(model).id == model


def test_chat_completion(client, model):
    response = client.chat.completions.create(model=model, messages=HELLO, max_tokens=6, temperature=0)
    choice = response.choices[0]
    assert response.object == "chat.completion"
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason == "length"
    usage = response.usage
    assert usage.completion_tokens == 6
    assert usage.prompt_tokens > 10 and usage.total_tokens == usage.prompt_tokens + 6
    assert usage.prompt_tokens_details.cached_tokens >= 0
    assert response.service_tier == "default"


def test_text_completion_with_several_prompts(client, model):
    response = client.completions.create(model=model, prompt=["1, 2, 3,", "a, b, c,"], max_tokens=3, temperature=0, n=2)
    assert response.object == "text_completion"
    assert [c.index for c in response.choices] == [0, 1, 2, 3]
    assert response.choices[0].text == response.choices[1].text  # greedy: both choices of one prompt agree
    assert response.choices[0].text != response.choices[2].text
    assert response.usage.completion_tokens == 12


def test_completion_takes_token_ids(client, model, server):
    with server.http() as http:
        ids = http.post("/tokenize", json={"prompt": "1, 2, 3,"}).json()["tokens"]
    by_text = client.completions.create(model=model, prompt="1, 2, 3,", max_tokens=4, temperature=0)
    by_ids = client.completions.create(model=model, prompt=ids, max_tokens=4, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text
    assert by_ids.usage.prompt_tokens == len(ids)


def test_streaming_chat_with_usage_chunk(client, model):
    chunks = list(
        client.chat.completions.create(
            model=model,
            messages=HELLO,
            max_tokens=8,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    *content, usage = chunks
    assert usage.choices == [] and usage.usage.completion_tokens == 8
    assert all(c.usage is None for c in content)
    assert content[-1].choices[0].finish_reason == "length"
    text = "".join(c.choices[0].delta.content or "" for c in content)
    whole = client.chat.completions.create(model=model, messages=HELLO, max_tokens=8, temperature=0)
    assert text == whole.choices[0].message.content


def test_stream_ends_with_done(server, model):
    body = {"model": model, "prompt": "1, 2, 3,", "max_tokens": 3, "temperature": 0, "stream": True}
    with server.http() as http, http.stream("POST", "/v1/completions", json=body) as response:
        events = [line for line in response.iter_lines() if line]
    assert response.headers["content-type"].startswith("text/event-stream")
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    assert all(c["object"] == "text_completion" for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_stop_sequence_cuts_the_output(client, model):
    free = client.chat.completions.create(model=model, messages=HELLO, max_tokens=24, temperature=0)
    text = free.choices[0].message.content
    stop = text[len(text) // 2 :][:3]
    assert stop.strip(), text
    stopped = client.chat.completions.create(model=model, messages=HELLO, max_tokens=24, temperature=0, stop=[stop])
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].message.content == text[: text.index(stop)]


def test_n_choices_sample_independently(client, model):
    response = client.chat.completions.create(model=model, messages=HELLO, max_tokens=8, temperature=1.0, n=3, seed=7)
    assert [c.index for c in response.choices] == [0, 1, 2]
    assert len({c.message.content for c in response.choices}) > 1
    assert 3 <= response.usage.completion_tokens <= 24


def test_n_choices_stream_with_their_indices(client, model):
    chunks = list(
        client.chat.completions.create(
            model=model,
            messages=HELLO,
            max_tokens=4,
            temperature=0,
            n=2,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    finished = [c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason]
    assert sorted(finished) == [0, 1]
    assert chunks[-1].usage.completion_tokens == 8


def test_seed_reproduces_a_sampled_completion(client, model):
    def sample(seed):
        return (
            client.chat.completions.create(
                model=model, messages=HELLO, max_tokens=12, temperature=1.0, top_p=0.95, seed=seed
            )
            .choices[0]
            .message.content
        )

    first = sample(1234)
    assert sample(1234) == first
    assert any(sample(seed) != first for seed in (1, 2, 3))


def test_logprobs(client, model):
    response = client.chat.completions.create(
        model=model, messages=HELLO, max_tokens=3, temperature=0, logprobs=True, top_logprobs=2
    )
    content = response.choices[0].logprobs.content
    assert len(content) == 3
    assert "".join(t.token for t in content) == response.choices[0].message.content
    for token in content:
        assert token.logprob <= 0 and len(token.top_logprobs) == 2
        assert token.top_logprobs[0].token == token.token  # greedy picks the most likely token
    completion = client.completions.create(model=model, prompt="1, 2, 3,", max_tokens=3, temperature=0, logprobs=1)
    logprobs = completion.choices[0].logprobs
    assert "".join(logprobs.tokens) == completion.choices[0].text
    assert logprobs.text_offset[0] == 0 and len(logprobs.top_logprobs) == 3


@pytest.mark.parametrize("tier", ["priority", "default", "flex"])
def test_response_echoes_the_service_tier(client, model, tier):
    response = client.chat.completions.create(model=model, messages=HELLO, max_tokens=1, service_tier=tier)
    assert response.service_tier == tier


def test_priority_extension_picks_the_tier(client, model):
    response = client.chat.completions.create(model=model, messages=HELLO, max_tokens=1, extra_body={"priority": 2})
    assert response.service_tier == "flex"


def test_tokenize_and_detokenize_round_trip(server):
    with server.http() as http:
        tokens = http.post("/tokenize", json={"prompt": "Hello, carpool!"}).json()
        assert tokens["count"] == len(tokens["tokens"]) > 2
        assert http.post("/detokenize", json={"tokens": tokens["tokens"]}).json() == {"prompt": "Hello, carpool!"}
        chat = http.post("/tokenize", json={"messages": HELLO}).json()
        assert chat["count"] > tokens["count"]


def test_health(server):
    with server.http() as http:
        assert http.get("/health").json() == {"status": "ok"}
