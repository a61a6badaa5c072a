"""`carpool bench prefill` against a scripted server whose prefill time per prompt token is known."""

import json
import time

import pytest
from live_server import ServedApp
from starlette.applications import Starlette
from starlette.responses import JSONResponse
from starlette.routing import Route

from carpool.bench.prefill import distinct_documents
from carpool.cli import main

SECONDS_PER_TOKEN = 0.0005


def scripted_app(chars_per_token: int) -> tuple[Starlette, list[str]]:
    """Counts a prompt as len / chars_per_token tokens and 'prefills' them at SECONDS_PER_TOKEN each."""
    seen: list[str] = []

    async def models(request):
        return JSONResponse({"object": "list", "data": [{"id": "scripted", "object": "model"}]})

    async def completions(request):
        body = await request.json()
        assert body["max_tokens"] == 1 and body["model"] == "scripted"
        seen.append(body["prompt"])
        tokens = len(body["prompt"]) // chars_per_token
        time.sleep(tokens * SECONDS_PER_TOKEN)  # noqa: ASYNC251 (a server busy computing holds its loop)
        return JSONResponse(
            {
                "object": "text_completion",
                "choices": [{"index": 0, "text": "x"}],
                "usage": {"prompt_tokens": tokens, "completion_tokens": 1, "total_tokens": tokens + 1},
            }
        )

    return Starlette(
        routes=[Route("/v1/models", models), Route("/v1/completions", completions, methods=["POST"])]
    ), seen


def test_prefill_bench_times_each_server_on_the_same_new_prompts(tmp_path, capsys):
    fast, fast_seen = scripted_app(chars_per_token=8)  # half the tokens in half the time: the same tok/s
    slow, slow_seen = scripted_app(chars_per_token=4)
    out = tmp_path / "prefill.json"
    with ServedApp(fast) as a, ServedApp(slow) as b:
        assert (
            main(
                [
                    "bench",
                    "prefill",
                    "--url",
                    str(a.base_url),
                    "--label",
                    "fast",
                    "--url",
                    str(b.base_url),
                    "--label",
                    "slow",
                    "--prompts",
                    "3",
                    "--prompt-chars",
                    "2000",
                    "--out",
                    str(out),
                ]
            )
            == 0
        )
    assert fast_seen == slow_seen and len(fast_seen) == 4 and len(set(fast_seen)) == 4  # warm-up + 3, all distinct
    assert all(len(prompt) == 2000 for prompt in fast_seen)
    reports = json.loads(out.read_text())
    assert [r["label"] for r in reports] == ["fast", "slow"] and all(r["prompts"] == 3 for r in reports)
    assert [r["prompt_tokens_median"] for r in reports] == [250, 500]
    for r in reports:  # tokens over seconds, the seconds at least the scripted prefill
        assert r["seconds_median"] >= r["prompt_tokens_median"] * SECONDS_PER_TOKEN
        assert r["prompt_tokens_per_s"] == pytest.approx(1 / SECONDS_PER_TOKEN, rel=0.5)
    assert "| fast | 3 | 250 |" in capsys.readouterr().out


def test_documents_are_distinct_and_too_many_is_an_error():
    docs = distinct_documents(6, 8400)
    assert len(set(docs)) == 6 and all(len(d) == 8400 for d in docs)
    with pytest.raises(ValueError, match="prompts: only"):
        distinct_documents(10**6, 8400)
