"""A Message Batch through `kill -9` with the official `anthropic` SDK: after the restart it ends, every custom_id
has exactly one result, and each succeeded message has exactly one ledger row, at the batch tier."""

import sqlite3
import time
from collections import Counter
from pathlib import Path

import anthropic
from live_server import LiveServer

NUM_REQUESTS = 8


def test_a_killed_server_finishes_the_message_batch_after_restart(tmp_path):
    # Two sequence slots make the batch slow enough to be caught half done.
    server = LiveServer("--max-num-seqs", "2", home=str(tmp_path))
    model = server.client().models.list().data[0].id
    requests = [
        {
            "custom_id": f"job-{i}",
            "params": {
                "model": model,
                "max_tokens": 6,
                "messages": [{"role": "user", "content": f"Write a word that starts with {chr(97 + i)}."}],
            },
        }
        for i in range(NUM_REQUESTS)
    ]
    try:
        batch = _client(server).messages.batches.create(requests=requests)
        # Anthropic counts every request as processing until the end; the OpenAI Batch API shows the progress.
        store_id = "batch_" + batch.id.removeprefix("msgbatch_")
        deadline = time.monotonic() + 120
        while server.client().batches.retrieve(store_id).request_counts.completed < 2:
            assert time.monotonic() < deadline
            time.sleep(0.05)
    finally:
        server.kill()

    server = server.restart()
    try:
        client = _client(server)
        deadline = time.monotonic() + 240
        while (ended := client.messages.batches.retrieve(batch.id)).processing_status != "ended":
            assert time.monotonic() < deadline
            time.sleep(0.2)
        assert ended.request_counts.succeeded == NUM_REQUESTS
        results = list(client.messages.batches.results(batch.id))
        assert Counter(line.custom_id for line in results) == Counter(f"job-{i}" for i in range(NUM_REQUESTS))
        assert all(line.result.type == "succeeded" for line in results)
    finally:
        server.stop()
    ledger = sqlite3.connect(Path(server.home) / "carpool.db")
    # A line's row is named by the request id of the run that answered it (a fresh req_... a run): one billed row
    # at the batch tier per answered line, and the lines the kill cut off withheld, never billed.
    billed = ledger.execute("SELECT tier FROM ledger WHERE cost > 0 AND finish_reason <> 'withheld'").fetchall()
    assert billed == [("batch",)] * len(results), billed


def _client(server: LiveServer) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)
