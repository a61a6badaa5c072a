"""What a replay of recorded traffic needs is in the ledger and no text is: each row has the unix time its
request arrived and its prompt's chain of prefix-cache block hashes, salted per key as the cache is, so a prefix
two requests of one key share is visible as shared, the same prompt of another key is not, and no word of it is
kept."""

import asyncio
import time

import httpx

from carpool.economics import keys as key_store
from carpool.economics.contract import read_block_chain

SYSTEM = (
    "You are the help line of a bicycle shop. Answer in one short sentence, politely, and never invent prices. " * 2
)


def chat(app, secret: str, question: str, request_id: str) -> httpx.Response:
    body = {
        "model": "tiny",
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
        "max_tokens": 2,
        "temperature": 0,
    }
    headers = {"Authorization": f"Bearer {secret}", "x-request-id": request_id}

    async def send():
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://carpool", timeout=60
        ) as client:
            return await client.post("/v1/chat/completions", json=body, headers=headers)

    return asyncio.run(send())


def test_rows_keep_arrival_and_salted_block_chains_and_no_text(engine, ledger_app):
    app, gate, conn = ledger_app
    _, acme = key_store.create_key(conn, "acme")
    _, globex = key_store.create_key(conn, "globex")
    started = time.time()
    for secret, question, request_id in (
        (acme, "Do you repair tyres?", "acme-1"),
        (acme, "When do you open on Sundays?", "acme-2"),
        (globex, "Do you repair tyres?", "globex-1"),
    ):
        assert chat(app, secret, question, request_id).status_code == 200
    gate.flush(timeout=30)
    rows = {
        row["request_id"]: row
        for row in conn.execute(
            "SELECT request_id, time, arrived, prompt_block_chain, uncached_prompt_tokens, cache_read_tokens"
            " FROM ledger"
        ).fetchall()
    }
    block_size = engine.config.block_size
    chains = {}
    for request_id, row in rows.items():
        assert started <= row["arrived"] <= row["time"]
        [chain] = read_block_chain(row["prompt_block_chain"])
        assert len(chain) == (row["uncached_prompt_tokens"] + row["cache_read_tokens"]) // block_size >= 2
        assert not any(word in str(tuple(row)) for word in ("bicycle", "tyres", "Sundays"))
        chains[request_id] = chain
    shared = len(SYSTEM) // 8 // block_size  # well inside the system prompt, whatever the tokenizer
    assert chains["acme-1"][:shared] == chains["acme-2"][:shared]  # one key's shared prefix shows as shared
    assert not set(chains["acme-1"]) & set(chains["globex-1"])  # the same prompt of another key: nothing shared
    # They are the prefix cache's own keys, cut to their first bytes: acme's blocks are cached under them.
    cached = {digest[: len(chains["acme-1"][0])] for digest in engine.engine.block_manager.cached}
    assert set(chains["acme-1"]) <= cached
