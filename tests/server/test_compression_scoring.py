"""The scorer's signal over HTTP: /v1/completions `prompt_logprobs: k` (vLLM's extension) reports every prompt
token's logprob and rank and the top k, from the same numbers the engine computes (tests/engine checks those
against a full forward)."""

import asyncio
import math

import httpx

from carpool.server.app import create_app

PROMPT = "The capital of France is Paris. The capital of Italy is Rome."


def post(app, body):
    async def send():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://carpool") as client:
            return await client.post("/v1/completions", json=body)

    return asyncio.run(send())


def test_completions_report_prompt_logprobs_in_vllm_shape(engine):
    app = create_app({"m": engine})
    answer = post(app, {"prompt": PROMPT, "max_tokens": 1, "prompt_logprobs": 2}).json()
    entries = answer["choices"][0]["prompt_logprobs"]
    prompt_ids = engine.door.tokenize_prompt(PROMPT)
    assert len(entries) == len(prompt_ids) == answer["usage"]["prompt_tokens"] and entries[0] is None
    for token, entry in zip(prompt_ids[1:], entries[1:]):
        own = entry[str(token)]
        assert own["logprob"] <= 0 and own["decoded_token"] == engine.engine.tokenizer.decode([token])
        best = next(e for e in entry.values() if e["rank"] == 1)
        assert best["logprob"] >= own["logprob"]  # rank 1 is the likeliest token
        assert (own["rank"] == 1) == math.isclose(own["logprob"], best["logprob"], abs_tol=1e-6)
        assert len(entry) in (2, 3)  # the prompt's token and the top 2, which may include it
    # The model has seen this fact: "Rome" after "The capital of Italy is" ranks first or close to it.
    assert entries[-1][str(prompt_ids[-1])]["rank"] <= 5


def test_prompt_logprobs_are_refused_when_out_of_range_or_streamed(engine):
    app = create_app({"m": engine})
    for extra in ({"prompt_logprobs": 21}, {"prompt_logprobs": -1}, {"prompt_logprobs": 1, "stream": True}):
        response = post(app, {"prompt": PROMPT, "max_tokens": 1} | extra)
        assert response.status_code == 400 and response.json()["error"]["param"] == "prompt_logprobs"
    assert "prompt_logprobs" not in post(app, {"prompt": PROMPT, "max_tokens": 1}).json()["choices"][0]
