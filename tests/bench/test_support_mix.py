"""The help line's mixed workload: three in four turns simple (a desk's one-word label from chatterbot-corpus),
the rest GSM8K, labelled, shuffled the same way every time."""

from carpool.bench.support_mix import DESKS, SIMPLE_MAX_TOKENS, mix
from carpool.server.cascade.runs import final_number


def test_the_mix_is_three_simple_turns_in_four_every_one_labelled():
    turns = mix()
    simple = [turn for turn in turns if turn.get("max_tokens") == SIMPLE_MAX_TOKENS]
    hard = [turn for turn in turns if "max_tokens" not in turn]
    assert len(simple) + len(hard) == len(turns) and abs(len(simple) / len(turns) - 0.75) < 0.01
    assert {turn["answer"] for turn in simple} == set(DESKS.values())
    assert all(final_number(turn["answer"]) is not None for turn in hard)
    assert all(turn["prompt"].endswith("The answer is <number>.") for turn in hard)
    assert mix() == turns
