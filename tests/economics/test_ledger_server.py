"""The ledger gate in a live `carpool serve`: keys, budgets, revocation, the usage report and the cost counter."""

import json

import httpx
import openai
import pytest
from live_server import LiveServer

from carpool.cli import main

QUESTION = [{"role": "user", "content": "Name three rivers."}]


def create_key(capsys, db, *options) -> tuple[str, str]:
    assert main(["keys", "create", "--db", str(db), *options]) == 0
    secret = capsys.readouterr().out.strip()
    assert main(["keys", "list", "--db", str(db), "--format", "json"]) == 0
    key_id = json.loads(capsys.readouterr().out)[-1]["key_id"]
    return secret, key_id


def test_budget_revocation_report_and_cost_counter(tmp_path, capsys):
    db = tmp_path / "carpool.db"  # LiveServer points CARPOOL_DB at home/carpool.db
    spender, spender_id = create_key(capsys, db, "--tenant", "acme", "--budget", "0.00001", "--budget-period", "day")
    admin, _ = create_key(capsys, db, "--tenant", "ops", "--admin")
    server = LiveServer("--metrics-tenants", home=str(tmp_path))
    try:
        url = f"{server.url}/v1"
        acme = openai.OpenAI(base_url=url, api_key=spender, max_retries=0)
        model = acme.models.list().data[0].id
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=url, api_key="sk-cp-wrong", max_retries=0).models.list()

        first = acme.chat.completions.create(model=model, messages=QUESTION, max_tokens=4, temperature=0)
        with pytest.raises(openai.RateLimitError) as refused:  # what is left cannot hold this one's worst case
            acme.chat.completions.create(model=model, messages=QUESTION, max_tokens=200)
        assert refused.value.code == "insufficient_quota" and refused.value.param == "max_tokens"

        report = httpx.get(
            f"{url}/usage", params={"group_by": "tenant"}, headers={"Authorization": f"Bearer {admin}"}, timeout=30
        ).json()
        row = next(r for r in report["data"] if r["group"] == "acme")
        assert row["requests"] == 1
        assert row["output_tokens"] == first.usage.completion_tokens
        assert row["uncached_prompt_tokens"] + row["cache_read_tokens"] == first.usage.prompt_tokens
        assert httpx.get(f"{url}/usage", headers={"Authorization": f"Bearer {spender}"}, timeout=30).status_code == 403

        assert main(["keys", "revoke", "--db", str(db), spender_id]) == 0
        with pytest.raises(openai.AuthenticationError):
            acme.models.list()

        cost = server.metrics()[("carpool:cost_total", frozenset({("tenant", "acme"), ("tier", "default")}))]
        assert cost == pytest.approx(row["cost"])
        assert cost > 0
    finally:
        server.stop()


def test_fifty_concurrent_clients_lose_no_ledger_row(tmp_path):
    from concurrent.futures import ThreadPoolExecutor

    server = LiveServer(home=str(tmp_path))  # no keys: open, but every request is still on the ledger
    try:
        client = server.client()
        model = client.models.list().data[0].id
        before = server.wait_idle()

        def ask(i):
            messages = [{"role": "user", "content": f"Say the number {i}."}]
            return client.chat.completions.create(model=model, messages=messages, max_tokens=3, temperature=0)

        with ThreadPoolExecutor(50) as pool:
            replies = list(pool.map(ask, range(50)))
        after = server.wait_idle()
        report = httpx.get(f"{server.url}/v1/usage", params={"group_by": "model"}, timeout=30).json()["total"]
    finally:
        server.stop()

    def moved(name):
        return sum(v for (n, labels), v in after.items() if n == name) - sum(
            v for (n, labels), v in before.items() if n == name
        )

    assert report["requests"] == 50
    assert report["output_tokens"] == sum(r.usage.completion_tokens for r in replies)
    assert report["output_tokens"] == moved("carpool:generation_tokens_total")
    prompt_tokens = report["uncached_prompt_tokens"] + report["cache_read_tokens"]
    assert prompt_tokens == sum(r.usage.prompt_tokens for r in replies) == moved("carpool:prompt_tokens_total")
