"""The replica benches' traffic: sessions of turns under tenants' cache salts, made from the real prompt sets in
carpool/bench/data. `carpool bench replicas` replays it against live servers and `carpool bench simulate` through
the discrete-event model, so both read it from here."""

import random
from collections import defaultdict
from dataclasses import dataclass

from carpool.bench.datasets import conversations, long_docs
from carpool.models import Tokenizer


@dataclass(frozen=True)
class Turn:
    prompt_token_ids: list[int]
    output_tokens: int


@dataclass(frozen=True)
class Session:
    """Turns sent one after another (the next when the previous finishes), under one tenant's cache salt."""

    turns: list[Turn]
    salt: str | None = None


def workload(
    tokenizer: Tokenizer, meetings: int, max_doc_words: int, chats: int, tenants: int, max_tokens: int, seed: int = 0
) -> list[Session]:
    """Document questions and chat conversations as sessions, shuffled so documents interleave."""
    by_meeting = defaultdict(list)
    for record in long_docs():
        if record["doc_words"] <= max_doc_words:
            by_meeting[record["meeting_id"]].append(record)
    sessions = []
    chosen = sorted(by_meeting.values(), key=len, reverse=True)[:meetings]
    for m, records in enumerate(chosen):
        document = max(records, key=lambda r: r["doc_words"])["document"]
        for record in records:
            text = f"{document}\n\nQuestion: {record['question_or_instruction']}"
            prompt = tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": text}]))
            sessions.append(Session([Turn(prompt, max_tokens)], salt=f"user:tenant-{m % tenants}"))
    multi_turn = (c for c in conversations() if len(c) >= 4)
    for c, chat in zip(range(chats), multi_turn):
        tenant = c % tenants
        history = [{"role": "system", "content": f"You are tenant {tenant}'s assistant. Be brief and exact."}]
        turns = []
        for turn in range(0, len(chat) - 1, 2):
            history.append({"role": "user", "content": chat[turn]["content"][:600]})
            turns.append(Turn(tokenizer.encode(tokenizer.apply_chat_template(history)), max_tokens))
            history.append({"role": "assistant", "content": chat[turn + 1]["content"][:600]})
        sessions.append(Session(turns[:3], salt=f"user:tenant-{tenant}"))
    random.Random(seed).shuffle(sessions)
    return sessions
