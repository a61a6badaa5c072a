"""Sampling parameters through the whole engine on the default model: each changes the output as defined."""

import pytest

from carpool import SamplingParams

FRANCE = "The capital of France is"
COUNT = "1, 2, 3, 4,"  # greedy: " 5, 6, 7, 8," with digits as single tokens after a space token


def greedy(llm, prompt: str, **kwargs):
    return llm.generate([prompt], SamplingParams(temperature=0, **{"max_tokens": 8} | kwargs))[0]


def chat(llm, question: str) -> str:
    return llm.chat_prompt([{"role": "user", "content": question}])


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": 1e-45},
        {"temperature": 1e-320},
        {"temperature": 1.0, "top_p": 1e-45},
        {"temperature": 1.0, "top_p": 1e-320},
    ],
)
def test_tiny_temperature_or_top_p_is_greedy_not_nan(llm, kwargs):
    out = llm.generate([FRANCE], SamplingParams(max_tokens=8, seed=5, **kwargs))[0]
    assert out.token_ids == greedy(llm, FRANCE).token_ids and out.finish_reason == "length"


def test_logit_bias_forces_or_forbids_a_token(llm, tokenizer):
    paris = greedy(llm, FRANCE).token_ids[0]
    banana = tokenizer.encode(" banana", add_special_tokens=False)[0]
    assert greedy(llm, FRANCE, max_tokens=3, logit_bias={banana: 100}).token_ids == [banana] * 3
    assert greedy(llm, FRANCE, logit_bias={paris: -100}).token_ids[0] != paris


def test_penalties_discourage_repeated_tokens(llm):
    prompt = "I love you. I love you. I love you."
    plain = greedy(llm, prompt, max_tokens=10).token_ids  # " I love you." again and again
    for kwargs in ({"frequency_penalty": 2.0}, {"presence_penalty": 2.0}, {"repetition_penalty": 2.0}):
        penalized = greedy(llm, prompt, max_tokens=10, **kwargs).token_ids
        assert len(set(penalized)) > len(set(plain)), kwargs


def test_min_tokens_holds_back_eos_and_stop_token_ids(llm, tokenizer):
    prompt = chat(llm, "What is 2+2? Answer with a number only.")
    short = greedy(llm, prompt, max_tokens=16)
    assert short.finish_reason == "stop" and short.token_ids[-1] == tokenizer.eos_token_id  # a few tokens, then EOS
    held = greedy(llm, prompt, max_tokens=16, min_tokens=len(short.token_ids) + 3)
    assert len(held.token_ids) >= len(short.token_ids) + 3
    assert tokenizer.eos_token_id not in held.token_ids[: len(short.token_ids) + 3]
    assert held.token_ids[: len(short.token_ids) - 1] == short.token_ids[:-1]

    first = short.token_ids[0]
    stopped = greedy(llm, prompt, stop_token_ids=[first])
    assert stopped.token_ids == [first] and stopped.finish_reason == "stop"
    assert first not in greedy(llm, prompt, stop_token_ids=[first], min_tokens=1).token_ids[:1]


def test_min_tokens_holds_back_stop_strings(llm):
    assert greedy(llm, COUNT, stop="6").text == " 5, "
    late = greedy(llm, COUNT, stop="6", min_tokens=8, max_tokens=12)  # "6" came at the 5th token
    assert "6" in late.text and "8" in late.text


def test_bad_words_never_appear(llm, tokenizer):
    paris = tokenizer.encode(" Paris", add_special_tokens=False)
    assert greedy(llm, FRANCE).token_ids[: len(paris)] == paris
    out = greedy(llm, FRANCE, bad_words=["Paris"])
    assert not set(paris) & set(out.token_ids)
    # A word of several tokens is banned only where the output would complete it: " 5," still comes out.
    counted = greedy(llm, COUNT, bad_words=["5, 6"])
    assert counted.text.startswith(" 5,") and "5, 6" not in counted.text


def test_best_of_keeps_the_candidate_with_the_highest_cumulative_logprob(llm):
    common = {"max_tokens": 6, "temperature": 1.2, "ignore_eos": True}
    candidates = llm.generate([FRANCE] * 4, [SamplingParams(seed=11 + k, logprobs=0, **common) for k in range(4)])
    scores = [sum(entry.logprob for entry in out.logprobs) for out in candidates]
    assert len({tuple(out.token_ids) for out in candidates}) > 1  # the choice matters
    best = llm.generate([FRANCE], SamplingParams(seed=11, best_of=4, **common))[0]
    assert best.token_ids == candidates[scores.index(max(scores))].token_ids
    assert best.cumulative_logprob == pytest.approx(max(scores))
    assert best.logprobs is None  # ranking needed logprobs; the caller did not ask for them


@pytest.mark.parametrize(
    "field, make",
    [
        ("prompt", lambda llm: llm.generate(["caf\udce9"], SamplingParams())),
        ("logit_bias", lambda llm: llm.generate(["hi"], SamplingParams(logit_bias={10**7: 1.0}))),
        ("stop_token_ids", lambda llm: llm.generate(["hi"], SamplingParams(stop_token_ids=[10**7], min_tokens=1))),
        ("params", lambda llm: llm.generate(["hi"], ["not params"])),
    ],
)
def test_bad_input_is_a_value_error_naming_the_field(llm, field, make):
    with pytest.raises(ValueError, match=field):
        make(llm)
    assert not llm.engine.has_unfinished_requests()
