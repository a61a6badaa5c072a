"""Sampling parameters through the official `openai` SDK (vLLM's extensions in `extra_body`): each changes the
response as defined, and none is silently ignored."""

import openai
import pytest

FRANCE = "The capital of France is"
LOVE = "I love you. I love you. I love you."  # greedy goes on repeating it
SUM = [{"role": "user", "content": "What is 2+2? Answer with a number only."}]  # greedy: a few tokens, then EOS


@pytest.fixture(scope="module")
def token_id(server):
    def encode(text: str) -> int:
        with server.http() as http:
            tokens = http.post("/tokenize", json={"prompt": text, "add_special_tokens": False}).json()["tokens"]
        assert len(tokens) == 1, (text, tokens)
        return tokens[0]

    return encode


def complete(client, model, prompt=FRANCE, **kwargs):
    return client.completions.create(model=model, prompt=prompt, **{"max_tokens": 8, "temperature": 0} | kwargs)


def test_logit_bias_forces_and_forbids_tokens(client, model, token_id):
    banana = token_id(" banana")
    forced = client.chat.completions.create(
        model=model, messages=SUM, max_tokens=3, temperature=0, logit_bias={str(banana): 100}
    )
    assert forced.choices[0].message.content == " banana" * 3
    plain = complete(client, model).choices[0].text
    assert plain.startswith(" Paris")
    assert not complete(client, model, logit_bias={str(token_id(" Paris")): -100}).choices[0].text.startswith(" Paris")


@pytest.mark.parametrize(
    "penalty", [{"frequency_penalty": 2.0}, {"presence_penalty": 2.0}, {"extra_body": {"repetition_penalty": 2.0}}]
)
def test_penalties_stop_the_repetition(client, model, penalty):
    plain = complete(client, model, LOVE, max_tokens=10).choices[0].text
    penalized = complete(client, model, LOVE, max_tokens=10, **penalty).choices[0].text
    assert plain.count("I love you") >= 2 and penalized.count("I love you") < plain.count("I love you")


def test_min_tokens_and_stop_token_ids(client, model, token_id):
    short = client.chat.completions.create(model=model, messages=SUM, max_tokens=16, temperature=0)
    assert short.choices[0].finish_reason == "stop"
    held = client.chat.completions.create(
        model=model,
        messages=SUM,
        max_tokens=16,
        temperature=0,
        extra_body={"min_tokens": short.usage.completion_tokens + 3},
    )
    assert held.usage.completion_tokens >= short.usage.completion_tokens + 3

    counted = complete(client, model, "1, 2, 3, 4,", extra_body={"stop_token_ids": [token_id("6")]}).choices[0]
    assert counted.finish_reason == "stop" and counted.text.startswith(" 5,") and "7" not in counted.text


def test_bad_words(client, model):
    assert "Paris" in complete(client, model).choices[0].text
    assert "Paris" not in complete(client, model, extra_body={"bad_words": ["Paris"]}).choices[0].text


def test_echo_puts_the_prompt_before_the_text(client, model, server):
    plain = complete(client, model, max_tokens=4).choices[0].text
    echoed = complete(client, model, max_tokens=4, echo=True)
    assert echoed.choices[0].text == FRANCE + plain
    assert echoed.usage.completion_tokens == 4
    streamed = "".join(c.choices[0].text for c in complete(client, model, max_tokens=4, echo=True, stream=True))
    assert streamed == FRANCE + plain
    with server.http() as http:
        ids = http.post("/tokenize", json={"prompt": "1, 2, 3,", "add_special_tokens": False}).json()["tokens"]
    assert complete(client, model, ids, max_tokens=2, echo=True).choices[0].text.startswith("1, 2, 3,")


def test_best_of_returns_the_most_likely_candidates(client, model):
    common = {"max_tokens": 5, "temperature": 1.3, "seed": 21, "extra_body": {"ignore_eos": True}}
    # n choices and best_of candidates both get seeds seed, seed + 1, ...: these are the candidates.
    candidates = complete(client, model, n=4, logprobs=0, **common).choices
    assert len({c.text for c in candidates}) > 2  # they differ, so the choice matters
    ranked = [c.text for c in sorted(candidates, key=lambda c: sum(c.logprobs.token_logprobs), reverse=True)]
    best = complete(client, model, n=2, best_of=4, **common)
    assert [c.text for c in best.choices] == ranked[:2]
    assert [c.index for c in best.choices] == [0, 1]
    assert best.usage.completion_tokens == 4 * 5  # every candidate is billed, as OpenAI does


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"n": 3, "best_of": 2}, "best_of"),
        ({"n": 1, "best_of": 2, "stream": True}, "best_of"),
        ({"prompt": ["a"] * 50, "best_of": 3}, "best_of"),
        ({"echo": True, "logprobs": 1}, "echo"),
        ({"prompt": [-1], "echo": True}, "prompt"),  # echoed ids are decoded only once found in the vocabulary
        ({"suffix": "and so on."}, "suffix"),
        ({"logit_bias": {"123456789": 5}}, "logit_bias"),
        ({"logit_bias": {"banana": 5}}, "logit_bias"),
        ({"logit_bias": {"12": 101}}, "logit_bias"),
        ({"frequency_penalty": -2.5}, "frequency_penalty"),
        ({"extra_body": {"min_tokens": 20}, "max_tokens": 10}, "min_tokens"),
        ({"extra_body": {"stop_token_ids": [10**7]}}, "stop_token_ids"),
        ({"extra_body": {"repetition_penalty": 0}}, "repetition_penalty"),
        ({"extra_body": {"bad_words": [" "]}}, "bad_words"),
    ],
)
def test_bad_values_are_400_naming_the_parameter(client, model, kwargs, param):
    kwargs = {"prompt": FRANCE, "max_tokens": 2} | kwargs
    with pytest.raises(openai.BadRequestError) as raised:
        client.completions.create(model=model, **kwargs)
    assert raised.value.body["param"] == param, raised.value.body


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"functions": [{"name": "f"}]}, "functions"),
        ({"function_call": "auto"}, "function_call"),
        ({"modalities": ["text", "audio"]}, "modalities"),
        ({"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
        ({"prediction": {"type": "content", "content": "Paris"}}, "prediction"),
        ({"store": True}, "store"),
        ({"reasoning_effort": "high"}, "reasoning_effort"),
    ],
)
def test_unsupported_openai_parameters_are_400_naming_them(client, model, fields, param):
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(model=model, messages=SUM, max_tokens=1, extra_body=fields)
    assert raised.value.body["param"] == param and "not supported" in raised.value.body["message"]


def test_unsupported_parameters_asking_for_nothing_are_accepted(client, model):
    history = SUM + [
        {"role": "assistant", "content": "4", "refusal": None, "tool_calls": []},
        {"role": "user", "content": "Thanks"},
    ]
    reply = client.chat.completions.create(
        model=model,
        max_tokens=1,
        messages=history,
        tools=[],
        response_format={"type": "text"},
        store=False,
        modalities=["text"],
    )
    assert reply.choices[0].message.content is not None
    history[1]["function_call"] = {"name": "f", "arguments": "{}"}
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(model=model, max_tokens=1, messages=history)
    assert raised.value.body["message"].startswith("messages[1].function_call: not supported")


def test_unknown_parameters_are_400_naming_them(client, model):
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(model=model, messages=SUM, max_tokens=1, extra_body={"temprature": 0.5})
    assert raised.value.body["message"] == "Unrecognized request argument supplied: temprature"
    assert raised.value.body["param"] == "temprature"
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(
            model=model, max_tokens=1, messages=[{"role": "user", "content": "hi", "colour": "red"}]
        )
    assert raised.value.body["message"] == "Unrecognized request argument supplied: messages[0].colour"
