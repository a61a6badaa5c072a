"""Prefix caching as clients see it: cached_tokens in usage, per-tenant isolation, and the /metrics counters."""

import pytest
from live_server import LiveServer

SYSTEM = "You are the archivist of a lighthouse. Answer briefly and cite the logbook page. " * 6


@pytest.fixture(scope="module")
def open_server():
    """No API keys: tenants are told apart by `user`, or by an explicit `cache_salt`."""
    live = LiveServer("--max-num-seqs", "4")
    yield live
    live.stop()


def ask(client, model, question, **extra):
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    return client.chat.completions.create(model=model, messages=messages, max_tokens=2, temperature=0, **extra)


def test_second_request_of_a_tenant_hits_and_another_tenant_does_not(open_server):
    client = open_server.client()
    model = client.models.list().data[0].id
    before = open_server.wait_idle()
    salted = {"extra_body": {"cache_salt": "team-x"}}
    replies = [
        ask(client, model, "When was page 1 written?", user="alice"),
        ask(client, model, "When was page 2 written?", user="alice"),
        ask(client, model, "When was page 2 written?", user="bob"),  # another tenant: no hit
        ask(client, model, "Who kept page 3?", user="carol", **salted),
        ask(client, model, "Who kept page 4?", user="dave", **salted),  # same salt as carol: a hit
    ]
    cached = [r.usage.prompt_tokens_details.cached_tokens for r in replies]
    assert cached[0] == 0 and cached[2] == 0 and cached[3] == 0
    # token-granular: every token the two prompts share, not just their whole 16-token blocks
    first, second = (
        open_server.http()
        .post(
            "/tokenize",
            json={"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]},
        )
        .json()["tokens"]
        for question in ("When was page 1 written?", "When was page 2 written?")
    )
    shared = next(i for i, (a, b) in enumerate(zip(first, second)) if a != b)
    assert shared >= 96 and shared % 16 and cached[1] == shared
    assert cached[4] >= 96
    after = open_server.wait_idle()

    def moved(name):
        return after[(name, frozenset())] - before[(name, frozenset())]

    assert moved("carpool:prefix_cache_hits_total") == sum(cached)
    assert moved("carpool:prefix_cache_queries_total") == sum(r.usage.prompt_tokens for r in replies)
    assert after[("carpool:prefix_cache_blocks", frozenset())] >= 6
    assert 0 < after[("carpool:prefix_cache_hit_rate", frozenset())] < 1


def test_streamed_usage_chunk_reports_cached_tokens(open_server):
    client = open_server.client()
    model = client.models.list().data[0].id
    ask(client, model, "Warm the cache.", user="erin")
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "And page 9?"}]
    stream = client.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=2,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        user="erin",
    )
    usage = [chunk.usage for chunk in stream if chunk.usage is not None]
    assert len(usage) == 1 and usage[0].prompt_tokens_details.cached_tokens >= 96
