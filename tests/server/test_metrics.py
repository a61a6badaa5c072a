"""/metrics in Prometheus text (read back with prometheus_client's own parser), and early termination: a client
that hangs up has its request aborted and its KV blocks back in the pool."""

import httpx
from prometheus_client.parser import text_string_to_metric_families

NO_LABELS = frozenset()
CHAT = "/v1/chat/completions"


def labels(**pairs) -> frozenset:
    return frozenset(pairs.items())


def test_every_promised_family_is_exported_with_its_type(server):
    text = httpx.get(f"{server.url}/metrics").text
    families = {family.name: family.type for family in text_string_to_metric_families(text)}
    promised = {
        "histogram": [
            "time_to_first_token_seconds",
            "inter_token_latency_seconds",
            "e2e_request_latency_seconds",
            "request_queue_time_seconds",
            "request_prefill_time_seconds",
            "request_decode_time_seconds",
            "iteration_tokens",
            "iteration_seqs",
        ],
        "counter": ["prompt_tokens", "generation_tokens", "request_success", "num_preemptions"],
        "gauge": ["num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"],
    }
    for kind, names in promised.items():
        for name in names:
            assert families.get(f"carpool:{name}") == kind, name


def test_counters_and_histograms_move_with_a_request(server, client, model):
    before = server.wait_idle()
    response = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Hi there"}],
        max_tokens=5,
        temperature=0,
        service_tier="flex",
        extra_body={"ignore_eos": True},
    )
    after = server.wait_idle()

    def delta(name, label_set):
        return after[(name, label_set)] - before.get((name, label_set), 0)

    flex = labels(tier="flex")
    assert delta("carpool:prompt_tokens_total", flex) == response.usage.prompt_tokens
    assert delta("carpool:generation_tokens_total", flex) == 5
    assert delta("carpool:request_success_total", labels(tier="flex", finished_reason="length")) == 1
    for histogram in (
        "time_to_first_token_seconds",
        "e2e_request_latency_seconds",
        "request_queue_time_seconds",
        "request_prefill_time_seconds",
        "request_decode_time_seconds",
    ):
        assert delta(f"carpool:{histogram}_count", flex) == 1, histogram
    assert delta("carpool:inter_token_latency_seconds_count", NO_LABELS) == 4  # 5 tokens, 4 gaps
    assert delta("carpool:iteration_tokens_count", NO_LABELS) >= 5
    assert delta("carpool:iteration_seqs_sum", NO_LABELS) >= 5


def test_disconnect_mid_stream_aborts_and_frees_the_pool(server, model):
    before = server.wait_idle()
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "Tell me a long story."}],
        "max_tokens": 4000,
        "ignore_eos": True,
        "stream": True,
    }
    with server.http() as http, http.stream("POST", CHAT, json=body) as response:
        data_lines = (line for line in response.iter_lines() if line.startswith("data:"))
        for _ in range(3):
            next(data_lines)
        busy = server.metrics()
        assert busy[("carpool:kv_cache_usage_perc", NO_LABELS)] > 0
        assert busy[("carpool:num_requests_running", NO_LABELS)] == 1
    after = server.wait_idle(timeout=15)  # idle means: no request left and every block back in the pool
    abort = ("carpool:request_success_total", labels(tier="default", finished_reason="abort"))
    assert after[abort] == before[abort] + 1


def test_disconnect_while_waiting_for_a_whole_response_aborts_too(server, model):
    before = server.wait_idle()
    body = {"model": model, "prompt": "Once upon a time", "max_tokens": 4000, "ignore_eos": True}
    try:
        with server.http() as http:
            http.post("/v1/completions", json=body, timeout=httpx.Timeout(60, read=1.0))
    except httpx.ReadTimeout:
        pass  # the client gives up and hangs up
    after = server.wait_idle(timeout=15)
    abort = ("carpool:request_success_total", labels(tier="default", finished_reason="abort"))
    assert after[abort] == before[abort] + 1
