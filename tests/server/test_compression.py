"""Prompt compression (LLMLingua over a served model's surprisal): protected text stays verbatim and the result
meets its budget; the `prompt_compression` extension bills the compressed prompt plus a scorer row tied to the
client request; /v1/compress and the extension refuse bad values with a 400 naming the parameter."""

import asyncio
import itertools

import httpx
import pytest

from carpool.bench.datasets import gsm8k
from carpool.economics.contract import Principal
from carpool.engine.sampling_params import SamplingParams
from carpool.server.app import create_app
from carpool.server.compression import Budget, Piece, compress
from carpool.server.compression.scorer import EngineScorer
from carpool.server.open_gate import RecordingGate

PROBLEMS = list(itertools.islice(gsm8k(), 3))
DEMOS = "\n\n".join(f"Question: {p['question']}\nAnswer: {p['answer']}" for p in PROBLEMS[:2])
QUESTION = f"Question: {PROBLEMS[2]['question']}\nAnswer:"
SYSTEM = "You are a careful math tutor. Think step by step."
KEEP = "Janet’s ducks lay 16 eggs per day."  # inside the first demonstration


def post(app, path, body):
    async def send():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://carpool") as client:
            return await client.post(path, json=body)

    return asyncio.run(send())


def count(tokenizer, texts):
    return sum(len(tokenizer.encode(text, add_special_tokens=False)) for text in texts)


@pytest.mark.parametrize("budget", [Budget(rate=0.5), Budget(target_tokens=120)])
def test_protected_text_stays_verbatim_and_the_result_meets_its_budget(engine, budget):
    scorer = EngineScorer(engine, "m", "default")
    pieces = [
        Piece(SYSTEM, True, 0),
        Piece(DEMOS[: DEMOS.index(KEEP)], False, 1),
        Piece(KEEP, True, 1),
        Piece(DEMOS[DEMOS.index(KEEP) + len(KEEP) :] + "\n\n", False, 1),
        Piece(QUESTION, True, 1),
    ]
    result = asyncio.run(compress(pieces, budget, scorer))
    system, user = result.texts
    assert system == SYSTEM and user.endswith(QUESTION) and KEEP in user
    original = count(scorer.tokenizer, [SYSTEM, DEMOS + "\n\n" + QUESTION])
    assert result.original_tokens == original
    target = budget.tokens(original)
    assert result.compressed_tokens == count(scorer.tokenizer, result.texts) <= target
    assert result.compressed_tokens >= 0.8 * target  # the budget is used, not undershot by dropping everything
    assert scorer.prompt_tokens > 0  # what its ledger row bills


def test_the_extension_bills_the_compressed_prompt_and_a_scorer_row(engine):
    gate = RecordingGate()
    app = create_app({"m": engine}, gate)
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": DEMOS + "\n\n" + QUESTION}]
    body = {"model": "m", "messages": messages, "max_tokens": 2, "temperature": 0}
    full = post(app, "/v1/chat/completions", body).json()["usage"]
    response = post(app, "/v1/chat/completions", body | {"prompt_compression": {"rate": 0.4}})
    usage = response.json()["usage"]
    assert usage["prompt_tokens_details"]["original_prompt_tokens"] == full["prompt_tokens"]
    assert usage["prompt_tokens"] < 0.6 * full["prompt_tokens"]
    assert "original_prompt_tokens" not in full["prompt_tokens_details"]
    plain, scored, billed = gate.records
    assert plain.original_prompt_tokens is None and billed.original_prompt_tokens == full["prompt_tokens"]
    assert billed.prompt_tokens == usage["prompt_tokens"] and billed.purpose == "request"
    assert scored.purpose == "compression" and scored.model == "m" and scored.prompt_tokens > 0
    assert scored.parent_request_id == response.headers["x-request-id"]
    assert scored.request_id in gate.admitted  # the scorer's work passed the gate before it ran


def test_compress_endpoint_answers_text_with_counts(engine):
    app = create_app({"m": engine}, RecordingGate())
    answer = post(app, "/v1/compress", {"prompt": DEMOS + "\n\n" + QUESTION, "target_tokens": 120}).json()
    assert answer["prompt"].endswith(QUESTION) and answer["compressed_tokens"] <= 120 < answer["original_tokens"]
    assert answer["kept_ratio"] == pytest.approx(answer["compressed_tokens"] / answer["original_tokens"], abs=1e-4)
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": DEMOS + "\n\n" + QUESTION}]
    answer = post(app, "/v1/compress", {"messages": messages, "rate": 0.5}).json()
    assert answer["messages"][0] == messages[0] and answer["messages"][1]["content"].endswith(QUESTION)


@pytest.mark.parametrize(
    ("path", "extra", "param"),
    [
        ("/v1/chat/completions", {"prompt_compression": {"rate": 0}}, "prompt_compression"),
        ("/v1/chat/completions", {"prompt_compression": {"rate": 1.5}}, "prompt_compression"),
        ("/v1/chat/completions", {"prompt_compression": {}}, "prompt_compression"),
        ("/v1/chat/completions", {"prompt_compression": {"rate": 0.5, "target_tokens": 9}}, "prompt_compression"),
        ("/v1/chat/completions", {"prompt_compression": {"target_tokens": "9"}}, "prompt_compression"),
        ("/v1/completions", {"prompt": [1, 2, 3], "prompt_compression": {"rate": 0.5}}, "prompt_compression"),
        ("/v1/compress", {"prompt": "a", "messages": [{"role": "user", "content": "b"}], "rate": 0.5}, "prompt"),
        ("/v1/compress", {"rate": 0.5}, "prompt"),
        ("/v1/compress", {"prompt": "a", "rate": 0}, "rate"),
        ("/v1/compress", {"prompt": "a"}, None),
        ("/v1/compress", {"prompt": "a", "rate": 0.5, "model": "nope"}, "model"),
    ],
)
def test_bad_values_are_a_400_naming_the_parameter(engine, path, extra, param):
    gate = RecordingGate()
    app = create_app({"m": engine}, gate)
    body = {
        "/v1/chat/completions": {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2},
        "/v1/completions": {"max_tokens": 2},
    }.get(path, {})
    response = post(app, path, body | extra)
    assert response.status_code == (404 if param == "model" else 400), response.text
    assert response.json()["error"]["param"] == param
    assert gate.records == []


def test_the_cli_compresses_through_a_running_server(server, tmp_path, capsys):
    from carpool.cli import main

    path = tmp_path / "prompt.txt"
    demo = DEMOS.split("\n\n")[0]  # one demonstration: the live server's engine is shared by many tests
    path.write_text(demo + "\n\n" + QUESTION)
    assert (
        main(
            [
                "compress",
                str(path),
                "--rate",
                "0.6",
                "--protect",
                KEEP,
                "--url",
                server.url,
                "--api-key",
                server.api_key,
            ]
        )
        == 0
    )
    out, err = capsys.readouterr()
    assert out.endswith(QUESTION) and KEEP in out and len(out) < len(demo) + len(QUESTION)
    assert "kept" in err
    assert main(["compress", str(path), "--rate", "0.5", "--url", server.url]) == 2  # no key: the server's 401
    assert "401" in capsys.readouterr().err


def test_a_start_that_did_not_compress_refuses_the_extension(engine):
    """A Batch API line reaches the serving start directly: compression there would be silently skipped."""
    from carpool.server.admission import TierQueues
    from carpool.server.errors import APIError
    from carpool.server.generation import Backends
    from carpool.server.metrics import ServerMetrics
    from carpool.server.protocol import ChatCompletionRequest
    from carpool.server.serving import Serving

    serving = Serving([Backends(engine, RecordingGate(), ServerMetrics(["m"]).models["m"], TierQueues(4), "m")])
    body = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "Hi"}], "prompt_compression": {"rate": 0.5}}
    )
    with pytest.raises(APIError, match="prompt_compression") as refused:
        serving.start_chat(body, Principal())
    assert refused.value.param == "prompt_compression"


def test_the_admitted_estimate_bounds_what_the_scorer_reads(engine):
    """The iterative pass reads each window after the protected text and kept tokens before it: a long system
    prompt is read once per window, far more than twice the compressible tokens."""
    from carpool.server.compression.compressor import scoring_bound

    scorer = EngineScorer(engine, "m", "default")
    demos = "\n\n".join(f"Question: {p['question']}\nAnswer: {p['answer']}" for p in itertools.islice(gsm8k(), 6))
    pieces = [Piece(SYSTEM * 20, True, 0), Piece(demos + "\n\n", False, 1), Piece(QUESTION, True, 1)]
    bound = scoring_bound(pieces, scorer)
    asyncio.run(compress(pieces, Budget(rate=0.9), scorer))
    assert scorer.prompt_tokens + scorer.output_tokens <= bound


def test_a_compression_that_scores_nothing_still_settles_its_admission(engine):
    """A gate that reserves at admission holds the budget until the record: the record comes with zero tokens."""
    gate = RecordingGate()
    app = create_app({"m": engine}, gate)
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": DEMOS + "\n\n" + QUESTION}],
        "max_tokens": 1,
        "prompt_compression": {"target_tokens": 100000},
    }
    assert post(app, "/v1/chat/completions", body).status_code == 200
    scored = next(r for r in gate.records if r.purpose == "compression")
    assert scored.request_id in gate.admitted and scored.prompt_tokens == 0


def test_a_scorer_that_fails_is_still_billed_for_what_it_read(engine, monkeypatch):
    gate = RecordingGate()
    app = create_app({"m": engine}, gate)

    async def failing(self, request):
        raise RuntimeError("scorer broke")

    monkeypatch.setattr(EngineScorer, "_last", failing)
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": DEMOS + "\n\n" + QUESTION}],
        "max_tokens": 1,
        "prompt_compression": {"rate": 0.5},
    }
    with pytest.raises(RuntimeError):
        post(app, "/v1/chat/completions", body)
    (scored,) = gate.records
    assert scored.purpose == "compression" and scored.request_id in gate.admitted and scored.prompt_tokens > 0


@pytest.mark.parametrize(
    ("path", "extra", "param"),
    [
        ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs"),
        ("/v1/completions", {"n": 2, "best_of": 1}, "best_of"),
        ("/v1/completions", {"echo": True, "logprobs": 0}, "echo"),
    ],
)
def test_a_body_the_start_refuses_is_not_compressed_or_billed(engine, path, extra, param):
    gate = RecordingGate()
    app = create_app({"m": engine}, gate)
    text = DEMOS + "\n\n" + QUESTION
    body = {"messages": [{"role": "user", "content": text}]} if path.endswith("chat/completions") else {"prompt": text}
    response = post(app, path, body | {"max_tokens": 2, "prompt_compression": {"rate": 0.5}} | extra)
    assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text
    assert gate.records == [] and gate.admitted == []


def test_a_prompt_longer_than_the_context_is_checked_after_compression():
    """The start's checks run before compressing, but the context length is the compressed prompt's to meet."""
    from carpool import LLM
    from carpool.engine.async_engine import AsyncEngine

    short = AsyncEngine(engine=LLM(max_num_seqs=2, max_model_len=256, dtype="float32", matmul="exact").engine)
    short.start()
    try:
        gate = RecordingGate()
        app = create_app({"m": short}, gate)
        body = {"model": "m", "messages": [{"role": "user", "content": DEMOS + "\n\n" + QUESTION}], "max_tokens": 2}
        assert post(app, "/v1/chat/completions", body).json()["error"]["code"] == "context_length_exceeded"
        response = post(app, "/v1/chat/completions", body | {"prompt_compression": {"target_tokens": 150}})
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["prompt_tokens_details"]["original_prompt_tokens"] > 256
    finally:
        short.stop()


class WholePrompts(EngineScorer):
    """The scorer before KV reuse: every window's whole prompt computed (no start, so no prefix-cache hit)."""

    async def surprisals(self, prompts, starts=None):
        return await super().surprisals(prompts)


def prefilled_while(engine, work) -> int:
    """Prompt tokens the engine computed while `work` ran, from its step stats. The engine thread calls step
    listeners just after handing out a step's outputs, so a one-token request after `work` marks the point by
    which the listener has seen every step of it (that request's own step is left out)."""
    steps = []
    engine.add_step_listener(lambda stats, outputs: steps.append((stats, {o.request_id for o in outputs})))
    result = asyncio.run(work)

    async def mark():
        async for _ in engine.generate(engine.door.request("mark", [1, 2], SamplingParams(max_tokens=1))):
            pass

    asyncio.run(mark())
    return result, sum(stats.num_prefill_tokens for stats, ids in list(steps) if stats and "mark" not in ids)


def test_the_iterative_pass_reads_its_prefix_from_the_cache_and_compresses_alike(engine):
    demos = "\n\n".join(f"Question: {p['question']}\nAnswer: {p['answer']}" for p in itertools.islice(gsm8k(), 6))
    pieces = [Piece(SYSTEM, True, 0), Piece(demos + "\n\n", False, 1), Piece(QUESTION, True, 1)]
    whole_scorer = WholePrompts(engine, "m", "default", cache_salt="whole")  # salts: no hit from other tests
    whole, whole_tokens = prefilled_while(engine, compress(pieces, Budget(rate=0.5), whole_scorer))
    reused_scorer = EngineScorer(engine, "m", "default", cache_salt="reused")
    reused, reused_tokens = prefilled_while(engine, compress(pieces, Budget(rate=0.5), reused_scorer))
    assert reused.texts == whole.texts
    assert whole_scorer.cached_tokens == 0 and reused_scorer.cached_tokens > 0
    assert reused_scorer.prompt_tokens == whole_scorer.prompt_tokens  # the same prompts, billed as read
    # The engine computed only what was not cached: each window's prefix is read, not prefilled again.
    assert whole_tokens == whole_scorer.prompt_tokens
    assert reused_tokens == whole_tokens - reused_scorer.cached_tokens < 0.7 * whole_tokens


ONE_PARAGRAPH = " ".join(p["question"] for p in PROBLEMS) + " What is the sum of the first two answers?"


def test_a_prompt_of_one_paragraph_is_compressed_within_it(engine):
    app = create_app({"m": engine}, RecordingGate())
    answer = post(app, "/v1/compress", {"prompt": ONE_PARAGRAPH, "rate": 0.3})
    assert answer.status_code == 200, answer.text
    answer = answer.json()
    assert answer["kept_ratio"] <= 0.35 and answer["compressed_tokens"] < answer["original_tokens"]
    assert answer["prompt"].endswith("What is the sum of the first two answers?")  # its last sentence is the question
    chat = {"model": "m", "messages": [{"role": "user", "content": ONE_PARAGRAPH}], "max_tokens": 2}
    compressed = post(app, "/v1/chat/completions", chat | {"prompt_compression": {"rate": 0.3}})
    assert compressed.status_code == 200, compressed.text
    details = compressed.json()["usage"]["prompt_tokens_details"]
    assert compressed.json()["usage"]["prompt_tokens"] < 0.6 * details["original_prompt_tokens"]


def test_a_prompt_with_nothing_to_compress_is_a_400_saying_why(engine):
    app = create_app({"m": engine}, RecordingGate())
    refused = post(app, "/v1/compress", {"prompt": "What is two plus two?", "rate": 0.3})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "prompt"
    assert "nothing can be compressed" in refused.json()["error"]["message"]
    chat = {"model": "m", "messages": [{"role": "user", "content": "What is two plus two?"}], "max_tokens": 2}
    refused = post(app, "/v1/chat/completions", chat | {"prompt_compression": {"rate": 0.3}})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "prompt_compression"


def test_a_scorer_whose_context_is_shorter_than_a_window_scores_shorter_windows(engine):
    """Before: a server started with --max-model-len 64 answered a 500 (IndexError) to a compressed request,
    its scorer returning surprisals for only the last 63 of a 96-token window (found by schemathesis)."""
    from carpool.server.compression.compressor import WINDOW_TOKENS, Scorer

    class ShortContext(Scorer):
        max_tokens = 20
        tokenizer = engine.engine.tokenizer

        async def surprisals(self, prompts, starts=None):
            assert all(len(prompt) <= self.max_tokens for prompt in prompts)
            return [[float("inf")] + [float(token % 7) for token in prompt[1:]] for prompt in prompts]

    text = " ".join(f"word{i}" for i in range(WINDOW_TOKENS))
    result = asyncio.run(compress([Piece(text)], Budget(rate=0.5), ShortContext()))
    assert 0 < result.compressed_tokens < result.original_tokens
