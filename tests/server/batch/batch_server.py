"""Helpers for Batch API tests: request lines, submission, waiting and reading results."""

import json
import time

import openai

TERMINAL = {"completed", "failed", "expired", "cancelled"}


def chat_line(custom_id: str, content: str, max_tokens: int = 4, **body) -> dict:
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {
            "messages": [{"role": "user", "content": content}],
            "max_tokens": max_tokens,
            "temperature": 0,
            **body,
        },
    }


def jsonl(lines: list[dict | str]) -> bytes:
    return "".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines).encode()


def submit(client: openai.OpenAI, lines: list[dict | str], endpoint: str = "/v1/chat/completions", **options):
    uploaded = client.files.create(file=("requests.jsonl", jsonl(lines)), purpose="batch")
    return client.batches.create(input_file_id=uploaded.id, endpoint=endpoint, completion_window="24h", **options)


def wait_until(client: openai.OpenAI, batch_id: str, done, timeout: float = 120):
    deadline = time.monotonic() + timeout
    while True:
        batch = client.batches.retrieve(batch_id)
        if done(batch) or time.monotonic() > deadline:
            assert done(batch), f"gave up waiting: {batch}"
            return batch
        time.sleep(0.1)


def wait_for_end(client: openai.OpenAI, batch_id: str, timeout: float = 120):
    return wait_until(client, batch_id, lambda batch: batch.status in TERMINAL, timeout)


def result_lines(client: openai.OpenAI, file_id: str | None) -> list[dict]:
    if file_id is None:
        return []
    return [json.loads(line) for line in client.files.content(file_id).text.splitlines()]
