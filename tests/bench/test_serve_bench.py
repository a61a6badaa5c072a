"""`carpool bench serve` against a scripted OpenAI-compatible stream whose timing is known, so the measured
TTFT, ITL and token counts can be checked, plus the report files it writes."""

import asyncio
import json

import httpx
import pytest
from live_server import ServedApp
from starlette.applications import Starlette
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from carpool.bench import serve
from carpool.bench.serve import RequestResult, _one_request, summarize
from carpool.cli import main

FIRST_TOKEN_DELAY = 0.05
TOKEN_GAP = 0.02
TOKENS = 4


def scripted_app() -> Starlette:
    """A role chunk at once (as some servers send), then TOKENS text chunks, the usage chunk and [DONE]."""

    async def models(request):
        return JSONResponse({"object": "list", "data": [{"id": "scripted", "object": "model"}]})

    async def chat(request):
        body = await request.json()
        assert body["stream"] and body["temperature"] == 0 and body["messages"][0]["content"]

        def event(choices, usage=None):
            return f"data: {json.dumps({'object': 'chat.completion.chunk', 'choices': choices, 'usage': usage})}\n\n"

        async def events():
            yield event([{"index": 0, "delta": {"role": "assistant", "content": ""}}])
            await asyncio.sleep(FIRST_TOKEN_DELAY)
            for i in range(TOKENS):
                if i:
                    await asyncio.sleep(TOKEN_GAP)
                yield event([{"index": 0, "delta": {"content": f"t{i}"}}])
            yield event([], {"prompt_tokens": 3, "completion_tokens": TOKENS, "total_tokens": 3 + TOKENS})
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    async def completions(request):  # as llama.cpp's server streams them: text in choices, no usage chunk
        body = await request.json()
        assert body["stream"] and isinstance(body["prompt"], str) and "messages" not in body

        async def events():
            await asyncio.sleep(FIRST_TOKEN_DELAY)
            for i in range(TOKENS):
                if i:
                    await asyncio.sleep(TOKEN_GAP)
                yield f"data: {json.dumps({'object': 'text_completion', 'choices': [{'index': 0, 'text': f't{i}'}]})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return Starlette(
        routes=[
            Route("/v1/models", models),
            Route("/v1/chat/completions", chat, methods=["POST"]),
            Route("/v1/completions", completions, methods=["POST"]),
        ]
    )


@pytest.fixture(scope="module")
def scripted_url():
    with ServedApp(scripted_app()) as client:
        yield str(client.base_url).rstrip("/")


def test_bench_serve_measures_and_reports(scripted_url, tmp_path, capsys):
    prefix = tmp_path / "report-1.5b"  # a dot in the name: the files are named after all of it
    assert (
        main(
            [
                "bench",
                "serve",
                "--url",
                scripted_url,
                "--concurrency",
                "1,3",
                "--num-requests",
                "3",
                "--max-tokens",
                "4",
                "--label",
                "scripted",
                "--out",
                str(prefix),
            ]
        )
        == 0
    )
    report = json.loads((tmp_path / "report-1.5b.json").read_text())
    assert (report["model"], report["label"], report["max_tokens"]) == ("scripted", "scripted", 4)
    assert [level["concurrency"] for level in report["levels"]] == [1, 3]
    for level in report["levels"]:
        assert (level["num_requests"], level["num_errors"], level["output_tokens"]) == (3, 0, 3 * TOKENS)
        assert level["ttft_p50_s"] >= FIRST_TOKEN_DELAY  # the empty role chunk is not the first token
        assert level["itl_p50_s"] >= TOKEN_GAP * 0.9
        assert level["ttft_p99_s"] >= level["ttft_p50_s"] and level["itl_p99_s"] >= level["itl_p50_s"]
        assert level["output_tokens_per_s"] == pytest.approx(level["output_tokens"] / level["duration_s"])
    assert (tmp_path / "report-1.5b.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = capsys.readouterr().out
    assert "TTFT p50" in table and "scripted" in table


def test_summary_statistics():
    results = [RequestResult(ok=True, output_tokens=10, ttft=t, itls=[0.1] * 9) for t in (0.1, 0.2, 0.3, 0.4)]
    results.append(RequestResult(ok=False, error="HTTP 500"))
    level = summarize(8, results, duration=2.0)
    assert (level.num_requests, level.num_errors, level.output_tokens) == (5, 1, 40)
    assert level.output_tokens_per_s == 20.0
    assert level.ttft_p50_s == pytest.approx(0.25) and level.ttft_p99_s == pytest.approx(0.397)
    assert level.itl_p50_s == pytest.approx(0.1)


def test_bench_serve_compares_servers_side_by_side(scripted_url, tmp_path, capsys):
    prefix = tmp_path / "both"
    assert (
        main(
            [
                "bench",
                "serve",
                "--url",
                scripted_url,
                "--url",
                scripted_url,
                "--label",
                "first",
                "--label",
                "second",
                "--concurrency",
                "2",
                "--num-requests",
                "2",
                "--max-tokens",
                "4",
                "--out",
                str(prefix),
            ]
        )
        == 0
    )
    reports = json.loads(prefix.with_suffix(".json").read_text())
    assert [r["label"] for r in reports] == ["first", "second"]
    assert all(r["levels"][0]["output_tokens"] == 2 * TOKENS for r in reports)
    out = capsys.readouterr().out
    assert "first / second:" in out and "2 streams: output tokens/s x" in out


def test_no_server_is_measured_until_every_one_answers_health(tmp_path, monkeypatch):
    """A server still warming up (503 from /health) would steal the CPU from the one measured beside it: the bench
    waits for every server before its first request to any (here the first, which has no /health, waits for the
    second), and gives up naming a server that never gets ready."""
    events, scripted = [], {route.path: route.endpoint for route in scripted_app().routes}

    def app(name: str, warming_polls: int | None) -> Starlette:
        async def health(request):
            events.append(f"{name} health")
            warming = events.count(f"{name} health") <= warming_polls
            return JSONResponse({"status": "warming" if warming else "ok"}, 503 if warming else 200)

        async def chat(request):
            events.append(f"{name} request")
            return await scripted["/v1/chat/completions"](request)

        routes = [Route("/v1/models", scripted["/v1/models"]), Route("/v1/chat/completions", chat, methods=["POST"])]
        return Starlette(routes=routes + ([Route("/health", health)] if warming_polls is not None else []))

    monkeypatch.setattr(serve, "READY_POLL_S", 0.01)
    with ServedApp(app("first", None)) as first, ServedApp(app("warming", 3)) as warming:
        urls = [str(client.base_url).rstrip("/") for client in (first, warming)]
        assert (
            main(
                [
                    "bench",
                    "serve",
                    "--url",
                    urls[0],
                    "--url",
                    urls[1],
                    "--concurrency",
                    "1",
                    "--num-requests",
                    "2",
                    "--max-tokens",
                    "4",
                    "--out",
                    str(tmp_path / "both"),
                ]
            )
            == 0
        )
        assert events[:4] == ["warming health"] * 4  # three 503s, then ok, before any request to either server
        assert events[4:] == ["first request"] * 3 + ["warming request"] * 3  # each: the warm-up and two measured
        never_ready = "http://127.0.0.1:9"  # nothing listens on the discard port
        with pytest.raises(TimeoutError, match="127.0.0.1:9 was not ready"):
            main(
                [
                    "bench",
                    "serve",
                    "--url",
                    urls[0],
                    "--url",
                    never_ready,
                    "--concurrency",
                    "1",
                    "--ready-timeout",
                    "0.2",
                    "--out",
                    str(tmp_path / "never"),
                ]
            )


def test_rounds_take_turns_on_new_prompts_and_pool(tmp_path, capsys):
    """--rounds 3: the servers in turns (A B, B A, A B), each round on prompts of its own (the same for both servers
    within it), the report pooling every round's requests and giving each round's ratio."""
    events, scripted = [], {route.path: route.endpoint for route in scripted_app().routes}

    def app(name: str) -> Starlette:
        async def chat(request):
            events.append((name, (await request.json())["messages"][0]["content"]))
            return await scripted["/v1/chat/completions"](request)

        return Starlette(
            routes=[Route("/v1/models", scripted["/v1/models"]), Route("/v1/chat/completions", chat, methods=["POST"])]
        )

    with ServedApp(app("a")) as a, ServedApp(app("b")) as b:
        urls = [str(client.base_url).rstrip("/") for client in (a, b)]
        assert (
            main(
                [
                    "bench",
                    "serve",
                    "--url",
                    urls[0],
                    "--url",
                    urls[1],
                    "--label",
                    "a",
                    "--label",
                    "b",
                    "--concurrency",
                    "1",
                    "--num-requests",
                    "2",
                    "--max-tokens",
                    "4",
                    "--rounds",
                    "3",
                    "--out",
                    str(tmp_path / "rounds"),
                ]
            )
            == 0
        )
    runs = [events[i : i + 3] for i in range(0, len(events), 3)]  # each server's run: the warm-up, two measured
    assert [run[0][0] for run in runs] == ["a", "b", "b", "a", "a", "b"]
    prompts = [[prompt for _, prompt in run] for run in runs]
    assert prompts[0] == prompts[1] and prompts[2] == prompts[3] and prompts[4] == prompts[5]
    assert len({prompt for run in prompts for prompt in run}) == 9  # three rounds, three prompts each
    reports = json.loads((tmp_path / "rounds.json").read_text())
    for report in reports:
        assert len(report["rounds"]) == 3 and all(r[0]["num_requests"] == 2 for r in report["rounds"])
        level = report["levels"][0]
        assert (level["num_requests"], level["output_tokens"]) == (6, 6 * TOKENS)
        assert level["duration_s"] == pytest.approx(sum(r[0]["duration_s"] for r in report["rounds"]))
    out = capsys.readouterr().out
    assert "output tokens/s by round x" in out and out.count(" x", out.index("by round")) >= 3
    assert main(["bench", "serve", "--url", urls[0], "--rounds", "0"]) == 2
    assert "rounds: expected at least 1" in capsys.readouterr().err


def test_bench_serve_drives_plain_completions_for_base_models(scripted_url, tmp_path):
    prefix = tmp_path / "completions"
    assert (
        main(
            [
                "bench",
                "serve",
                "--url",
                scripted_url,
                "--api",
                "completions",
                "--concurrency",
                "2",
                "--num-requests",
                "2",
                "--max-tokens",
                "4",
                "--out",
                str(prefix),
            ]
        )
        == 0
    )
    report = json.loads(prefix.with_suffix(".json").read_text())
    level = report["levels"][0]
    assert report["api"] == "completions"
    assert (level["num_errors"], level["output_tokens"]) == (0, 2 * TOKENS)  # counted from text chunks
    assert level["ttft_p50_s"] >= FIRST_TOKEN_DELAY and level["itl_p50_s"] >= TOKEN_GAP * 0.9


def _dropping_client(drops: int, answer_first: bool = False) -> tuple[httpx.AsyncClient, list[int]]:
    """A client whose first `drops` sends die as a stale keep-alive connection does (before any status line),
    or, with answer_first, whose first answer breaks off after its status line; later sends stream one token."""
    sends = []

    async def handler(request):
        sends.append(1)
        if len(sends) <= drops:
            raise httpx.RemoteProtocolError("Server disconnected without sending a response.", request=request)

        async def events():
            yield f"data: {json.dumps({'choices': [{'index': 0, 'delta': {'content': 'hi'}}]})}\n\n".encode()
            if answer_first and len(sends) == 1:
                raise httpx.RemoteProtocolError("peer closed connection", request=request)
            yield b"data: [DONE]\n\n"

        return httpx.Response(200, content=events(), headers={"content-type": "text/event-stream"})

    return httpx.AsyncClient(transport=httpx.MockTransport(handler), base_url="http://peer"), sends


def test_a_request_dropped_on_a_stale_connection_is_sent_again_once():
    async def one(drops, answer_first=False):
        client, sends = _dropping_client(drops, answer_first)
        async with client:
            return await _one_request(client, "m", "prompt", 4), len(sends)

    result, sends = asyncio.run(one(drops=1))
    assert (result.ok, result.retries, result.output_tokens, sends) == (True, 1, 1, 2)
    assert summarize(1, [result], 1.0).retries == 1
    result, sends = asyncio.run(one(drops=2))  # a server that keeps dropping: one resend, then an error
    assert (result.ok, sends) == (False, 2) and "without sending a response" in result.error
    result, sends = asyncio.run(one(drops=0, answer_first=True))  # it answered: the server saw it, no resend
    assert (result.ok, sends) == (False, 1) and "peer closed" in result.error
