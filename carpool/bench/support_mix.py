"""A help line's mixed traffic for routers and cascades (`python -m carpool.bench.support_mix --out FILE.jsonl`):
most turns simple, a few hard, every one labelled, as JSONL for `carpool cascade calibrate|evaluate --data`.

- Simple turns: which desk takes a customer's message, one word from DESKS. The messages and their labels are the
  conversations' opening lines and categories of chatterbot-corpus 1.3.3 (PyPI, BSD-3-Clause, English files; a
  pinned dev dependency), up to PER_DESK distinct messages per desk, answered in at most 8 tokens.
- Hard turns: GSM8K test problems (carpool/bench/data, MIT) with the cascade's answer instruction, 256 tokens.

The mix: SIMPLE_SHARE of turns simple. The seed's scenario is a customer-service line where "most turns are
simple, a few hard"; three in four is that, and leaves enough hard turns in a ~130-turn set (~1 in 4) that the
strong model's advantage on them is measurable on each half. Turns are shuffled with a fixed seed, so the
first and second halves (`--offset`/`--limit`) are disjoint splits of the same mix.
"""

import argparse
import json
import random
from pathlib import Path

from carpool.bench.datasets import gsm8k
from carpool.server.cascade.cli import GSM8K_SUFFIX

# corpus file -> desk. computers and tech_support are one desk; categories of chit-chat about the bot itself
# (ai, botprofile, emotion, psychology, gossip, humor) have no desk a help line would send them to.
DESKS = {
    "coding": "coding",
    "computers": "computers",
    "tech_support": "computers",
    "money": "money",
    "food": "food",
    "sports": "sports",
    "movies": "movies",
    "science": "science",
    "literature": "books",
    "politics": "politics",
    "greetings": "greeting",
}
_OPTION_ORDER = ("sports", "money", "coding", "food", "movies", "science", "computers", "politics", "greeting", "books")
PER_DESK = 10
SIMPLE_SHARE = 0.75
SIMPLE_MAX_TOKENS = 8
SEED = 51


def simple_prompt(message: str) -> str:
    """Measured on the 0.5B (greedy, 8 tokens): with the desks listed alphabetically after the quoted message it
    answered "books", the first, to nearly everything (7 of 48 right); this wording got 8 of 24 of a probe, the
    best of four (a few-shot list got 0: it started a list of its own)."""
    return (
        f"What is this message about?\nMessage: {message}\nOptions: {', '.join(_OPTION_ORDER)}\n"
        "Answer with the single best option word, nothing else."
    )


def simple_turns() -> list[dict]:
    import importlib.resources

    import yaml

    english = importlib.resources.files("chatterbot_corpus") / "data" / "english"
    by_desk: dict[str, list[str]] = {}
    for corpus, desk in DESKS.items():
        conversations = yaml.safe_load((english / f"{corpus}.yml").read_text(encoding="utf-8"))["conversations"]
        messages = by_desk.setdefault(desk, [])
        for conversation in conversations:
            message = conversation[0].strip() if conversation and isinstance(conversation[0], str) else ""
            if message and message not in messages:
                messages.append(message)
    rng = random.Random(SEED)
    turns = []
    for desk, messages in by_desk.items():
        for message in rng.sample(messages, min(PER_DESK, len(messages))):
            turns.append({"prompt": simple_prompt(message), "answer": desk, "max_tokens": SIMPLE_MAX_TOKENS})
    return turns


def mix() -> list[dict]:
    """Every simple turn, and GSM8K problems 0.. so that SIMPLE_SHARE of all turns are simple, shuffled."""
    simple = simple_turns()
    problems = zip(range(round(len(simple) * (1 - SIMPLE_SHARE) / SIMPLE_SHARE)), gsm8k())
    hard = [
        {"prompt": p["question"] + GSM8K_SUFFIX, "answer": "####" + p["answer"].split("####")[-1]} for _, p in problems
    ]
    turns = simple + hard
    random.Random(SEED).shuffle(turns)
    return turns


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m carpool.bench.support_mix", description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="the JSONL to write")
    args = parser.parse_args(argv)
    turns = mix()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("".join(json.dumps(turn) + "\n" for turn in turns), encoding="utf-8")
    simple = sum("max_tokens" in turn for turn in turns)
    print(f"{len(turns)} turns ({simple} simple, {len(turns) - simple} GSM8K) written to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
