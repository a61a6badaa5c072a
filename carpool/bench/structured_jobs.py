"""What `carpool bench structured` runs beside its validity and overhead figures: an extraction job through the
Batch API (every output checked against the schema, its cost read from the ledger) and the same JSON schema
sent to other OpenAI-compatible servers (llama.cpp's `llama-server`), validity and output tok/s side by side."""

import json
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

RECORD = {
    "type": "object",
    "additionalProperties": False,
    "required": ["name", "age", "city", "job"],
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer"},
        "city": {"type": "string", "maxLength": 30},
        "job": {"type": "string", "maxLength": 30},
    },
}
_FIRST = ["Maria", "Kenji", "Amara", "Lukas", "Sofia", "Omar", "Ingrid", "Tomás", "Priya", "Hugo", "Zainab", "Elena"]
_LAST = ["Rossi", "Tanaka", "Okafor", "Novak", "Silva", "Haddad", "Berg", "García", "Nair", "Laurent", "Bello"]
_CITIES = ["Lyon", "Osaka", "Lagos", "Prague", "Porto", "Beirut", "Bergen", "Seville", "Kochi", "Lille", "Accra"]
_JOBS = ["nurse", "carpenter", "teacher", "pilot", "baker", "engineer", "librarian", "chef", "farmer", "lawyer"]


def extraction_text(i: int) -> str:
    """The i-th synthetic note: one person's name, age, city and job, in varying order and wording."""
    name = f"{_FIRST[i % len(_FIRST)]} {_LAST[(i // 3) % len(_LAST)]}"
    age, city, job = 19 + (i * 7) % 60, _CITIES[(i // 2) % len(_CITIES)], _JOBS[(i * 5) % len(_JOBS)]
    return [
        f"{name}, {age}, moved to {city} last year and works as a {job}.",
        f"Our new {job} in {city} is {name}; they turned {age} in May.",
        f"Met {name} ({age}) at a conference in {city}. Profession: {job}.",
    ][i % 3]


def valid_record(text: str | None) -> bool:
    try:
        record = json.loads(text or "")
    except ValueError:
        return False
    return (
        isinstance(record, dict)
        and set(record) == set(RECORD["required"])
        and isinstance(record["age"], int)
        and not isinstance(record["age"], bool)
        and all(
            isinstance(record[k], str) and len(record[k]) <= RECORD["properties"][k]["maxLength"]
            for k in ("name", "city", "job")
        )
    )


def _extraction_body(i: int, max_tokens: int) -> dict:
    ask = f"Extract the person from this note as JSON: {extraction_text(i)}"
    return {
        "messages": [{"role": "user", "content": ask}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "response_format": {"type": "json_schema", "json_schema": {"name": "person", "strict": True, "schema": RECORD}},
    }


def batch_extraction(config, lines: int, max_tokens: int) -> dict:
    """`lines` extraction requests as one Batch API job on a local server with a ledger: valid outputs, wall
    time, and the job's cost and tokens as the ledger priced them (batch tier)."""
    import openai

    from carpool.bench.local_server import LocalServer

    requests = "".join(
        json.dumps(
            {
                "custom_id": f"note-{i}",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": _extraction_body(i, max_tokens),
            }
        )
        + "\n"
        for i in range(lines)
    )
    with (
        tempfile.TemporaryDirectory(prefix="carpool-bench-batch-") as workdir,
        LocalServer(config, Path(workdir)) as server,
    ):
        client = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0)
        start = time.monotonic()
        uploaded = client.files.create(file=("notes.jsonl", requests.encode()), purpose="batch")
        batch = client.batches.create(
            input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        while batch.status not in ("completed", "failed", "expired", "cancelled"):
            time.sleep(1)
            batch = client.batches.retrieve(batch.id)
        seconds = time.monotonic() - start
        results = (
            [json.loads(line) for line in client.files.content(batch.output_file_id).text.splitlines()]
            if batch.output_file_id
            else []
        )
        valid = sum(
            valid_record(r["response"]["body"]["choices"][0]["message"]["content"])
            for r in results
            if r.get("response") and r["response"]["status_code"] == 200
        )
        server.gate.flush()
        rows = server.gate.usage("model")
    return {
        "lines": lines,
        "status": batch.status,
        "valid": valid,
        "seconds": seconds,
        "cost": sum(row.cost for row in rows),
        "output_tokens": sum(row.output_tokens for row in rows),
        "prompt_tokens": sum(row.uncached_prompt_tokens + row.cache_read_tokens for row in rows),
    }


def compare_servers(urls: list[str], requests: int, concurrency: int, max_tokens: int) -> list[dict]:
    """The same extraction requests (json_schema, strict) against each server: valid outputs and output tok/s
    over the wall time, `concurrency` requests in flight."""
    rows = []
    for url in urls:
        with httpx.Client(base_url=url.rstrip("/") + "/v1", timeout=600) as client:
            model = client.get("/models").json()["data"][0]["id"]

            def one(i: int) -> tuple[bool, int]:
                body = client.post("/chat/completions", json=_extraction_body(i, max_tokens) | {"model": model}).json()
                choice = body["choices"][0]
                return (
                    choice["finish_reason"] == "stop" and valid_record(choice["message"]["content"]),
                    body["usage"]["completion_tokens"],
                )

            one(0)  # the server compiles the schema (and its tokenizer tables) once before the clock starts
            start = time.monotonic()
            with ThreadPoolExecutor(concurrency) as pool:
                answers = list(pool.map(one, range(requests)))
            seconds = time.monotonic() - start
        rows.append(
            {
                "url": url,
                "model": model,
                "requests": requests,
                "valid": sum(ok for ok, _ in answers),
                "output_tokens": sum(n for _, n in answers),
                "seconds": seconds,
                "tok_s": sum(n for _, n in answers) / seconds,
            }
        )
    return rows
