"""`carpool serve --model P --model P --served-model-name a --served-model-name b`: two engines behind one port,
each with its own KV pool (8 and 64 blocks here), driven by one loop on the server's main thread."""

import json
import time

import httpx
import openai
import pytest
from live_server import LiveServer
from prometheus_client.parser import text_string_to_metric_families

from carpool.models.loader import default_model_path

MODELS = ("a", "b")
POOL_BLOCKS = {"a": 8, "b": 64}
MESSAGES = [{"role": "user", "content": "Name a river."}]
PER_MODEL_FAMILIES = (
    "time_to_first_token_seconds",
    "inter_token_latency_seconds",
    "e2e_request_latency_seconds",
    "request_queue_time_seconds",
    "request_prefill_time_seconds",
    "request_decode_time_seconds",
    "iteration_tokens",
    "iteration_seqs",
    "prompt_tokens",
    "generation_tokens",
    "request_success",
    "num_preemptions",
    "num_requests_running",
    "num_requests_waiting",
    "kv_cache_usage_perc",
    "cache_config_info",
    "prefix_cache_queries",
    "prefix_cache_hits",
    "prefix_cache_blocks",
    "prefix_cache_hit_rate",
    "engine_phase_tokens",
    "engine_phase_seconds",
    "decode_steps",
    "decode_step_seconds",
)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = default_model_path()
    live = LiveServer(
        "--model",
        path,
        "--model",
        path,
        "--served-model-name",
        "a",
        "--served-model-name",
        "b",
        "--num-kv-blocks",
        str(POOL_BLOCKS["a"]),
        "--num-kv-blocks",
        str(POOL_BLOCKS["b"]),
        "--max-num-seqs",
        "4",
        home=str(tmp_path_factory.mktemp("home")),
    )
    yield live
    live.stop()


@pytest.fixture(scope="module")
def client(server):
    return server.client()


def samples(server) -> dict[tuple[str, frozenset], float]:
    """Every sample on /metrics, keyed by (name, all its labels)."""
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def sample(values, name: str, **labels) -> float:
    return values.get((name, frozenset(labels.items())), 0.0)


def usage_by_model(server) -> dict[str, dict]:
    report = httpx.get(f"{server.url}/v1/usage", params={"group_by": "model"}, timeout=30).json()
    return {row["group"]: row for row in report["data"]}


def test_models_lists_every_served_model(client):
    assert [m.id for m in client.models.list().data] == list(MODELS)
    assert client.models.retrieve("b").id == "b"
    with pytest.raises(openai.NotFoundError) as raised:
        client.models.retrieve("c")
    assert raised.value.body["code"] == "model_not_found"


def test_each_name_answers_from_its_own_engine_and_is_billed_as_itself(server, client):
    metrics_before, usage_before = samples(server), usage_by_model(server)
    chat = client.chat.completions.create(
        model="a", messages=MESSAGES, max_tokens=3, temperature=0, extra_body={"ignore_eos": True}
    )
    text = client.completions.create(
        model="b", prompt="1, 2, 3,", max_tokens=5, temperature=0, extra_body={"ignore_eos": True}
    )
    metrics_after, usage_after = samples(server), usage_by_model(server)
    assert (chat.model, text.model) == ("a", "b")
    for name, reply in (("a", chat), ("b", text)):
        generated = [
            sample(m, "carpool:generation_tokens_total", model_name=name, tier="default")
            for m in (metrics_before, metrics_after)
        ]
        assert generated[1] - generated[0] == reply.usage.completion_tokens, name
        before = usage_before.get(name, {"requests": 0, "output_tokens": 0})
        assert usage_after[name]["requests"] - before["requests"] == 1, name
        assert usage_after[name]["output_tokens"] - before["output_tokens"] == reply.usage.completion_tokens, name


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/tokenize"])
def test_an_unknown_model_is_404_naming_the_served_models(server, path):
    body = (
        {"model": "gpt-17", "prompt": "Hi"}
        if path != "/v1/chat/completions"
        else {"model": "gpt-17", "messages": MESSAGES}
    )
    with server.http() as http:
        response = http.post(path, json=body)
    assert response.status_code == 404
    error = response.json()["error"]
    assert (error["code"], error["param"]) == ("model_not_found", "model")
    assert "'gpt-17'" in error["message"] and "'a', 'b'" in error["message"]


def test_a_batch_routes_each_line_and_answers_an_unknown_model_on_its_line(client):
    lines = [
        {
            "custom_id": f"to-{name}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {"model": name, "messages": MESSAGES, "max_tokens": 3},
        }
        for name in ("a", "b", "c")
    ]
    data = "".join(json.dumps(line) + "\n" for line in lines).encode()
    uploaded = client.files.create(file=("lines.jsonl", data), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
    deadline = time.monotonic() + 60
    while batch.status not in ("completed", "failed") and time.monotonic() < deadline:
        time.sleep(0.1)
        batch = client.batches.retrieve(batch.id)
    assert batch.status == "completed", batch  # one line naming an unknown model does not fail the batch
    assert batch.request_counts.model_dump() == {"total": 3, "completed": 2, "failed": 1}
    answered = {}
    for file_id in (batch.output_file_id, batch.error_file_id):
        for line in client.files.content(file_id).text.splitlines():
            answered[json.loads(line)["custom_id"]] = json.loads(line)["response"]
    assert answered["to-a"]["body"]["model"] == "a" and answered["to-b"]["body"]["model"] == "b"
    assert answered["to-c"]["status_code"] == 404
    assert answered["to-c"]["body"]["error"]["code"] == "model_not_found"


def test_every_per_model_series_carries_the_model_name_of_both_models(server, client):
    for name in MODELS:
        client.completions.create(model=name, prompt="Hi", max_tokens=2)
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    names = {
        family.name: {s.labels.get("model_name") for s in family.samples}
        for family in text_string_to_metric_families(text)
    }
    for family in PER_MODEL_FAMILIES:
        assert names.get(f"carpool:{family}") == set(MODELS), family


def test_a_long_request_on_one_model_does_not_hold_up_the_other(server, client):
    def b_generated() -> float:
        return sample(samples(server), "carpool:generation_tokens_total", model_name="b", tier="default")

    body = {"model": "b", "prompt": "Once upon a time", "max_tokens": 900, "ignore_eos": True, "stream": True}
    with server.http() as http, http.stream("POST", "/v1/completions", json=body) as long_stream:
        chunks = (line for line in long_stream.iter_lines() if line.startswith("data:"))
        for _ in range(3):
            next(chunks)
        before = b_generated()
        short = client.completions.create(model="a", prompt="Hi", max_tokens=5, extra_body={"ignore_eos": True})
        assert short.usage.completion_tokens == 5
        assert sample(samples(server), "carpool:num_requests_running", model_name="b") == 1  # b is mid-story
        assert b_generated() > before  # and moved on while a answered


def test_each_engine_has_the_kv_pool_its_flag_gives(server, client):
    values = samples(server)
    for name, blocks in POOL_BLOCKS.items():
        assert (
            sample(values, "carpool:cache_config_info", model_name=name, block_size="16", num_blocks=str(blocks)) == 1
        ), name
    # 8 blocks of 16 tokens hold 128 tokens: a 150-token request fits b's pool but not a's.
    with pytest.raises(openai.BadRequestError) as raised:
        client.completions.create(model="a", prompt="Hi", max_tokens=150)
    assert raised.value.body["code"] == "context_length_exceeded"
    with client.completions.create(model="b", prompt="Hi", max_tokens=150, stream=True) as accepted:
        assert next(iter(accepted)).model == "b"
