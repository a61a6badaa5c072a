"""Readers for the real prompt sets shipped in carpool/bench/data (see its README for sources and licenses)."""

import json
import os
from collections.abc import Iterator
from pathlib import Path

SHIPPED = Path(__file__).resolve().parent / "data"


def data_dir() -> Path:
    """`CARPOOL_DATA_DIR`, else the prompt sets shipped with the package."""
    override = os.environ.get("CARPOOL_DATA_DIR")
    return Path(override) if override else SHIPPED


def _records(name: str) -> Iterator[dict]:
    path = data_dir() / name
    if not path.exists():
        raise FileNotFoundError(f"{path} not found: CARPOOL_DATA_DIR must name a folder holding {name}")
    with path.open(encoding="utf-8") as lines:
        for line in lines:
            yield json.loads(line)


def conversations() -> Iterator[list[dict]]:
    """Each chat in chat_prompts.jsonl as OpenAI-style messages (user/assistant alternating). The shipped file
    keeps the answers of multi-turn chats only: a two-turn chat is its opening prompt alone."""
    roles = {"human": "user", "gpt": "assistant"}
    for record in _records("chat_prompts.jsonl"):
        yield [{"role": roles[turn["from"]], "content": turn["value"]} for turn in record["conversations"]]


def first_human_turns(limit: int | None = None, max_chars: int | None = None) -> list[str]:
    """The opening user prompt of each conversation, in file order (optionally skipping very long ones)."""
    prompts = []
    for messages in conversations():
        text = messages[0]["content"]
        if max_chars is None or len(text) <= max_chars:
            prompts.append(text)
        if limit is not None and len(prompts) >= limit:
            break
    return prompts


def long_docs() -> Iterator[dict]:
    """Meeting transcripts with a question each (long_docs.jsonl); group by `meeting_id` for shared prefixes."""
    return _records("long_docs.jsonl")


def gsm8k() -> Iterator[dict]:
    """GSM8K test problems, `{"question", "answer"}`: the answer's last line is `#### <number>`."""
    return _records("gsm8k_test.jsonl")
