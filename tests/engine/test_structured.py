"""Constrained decoding through the whole engine on the default model: every output matches its constraint,
unconstrained neighbours in the batch are untouched, and a bad constraint fails at the door naming its field."""

import json
import re

import pytest

from carpool import SamplingParams
from carpool.engine.structured import StructuredOutput

PERSON = {
    "type": "object",
    "additionalProperties": False,
    "required": ["name", "age"],
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
    },
}


def chat(llm, question: str) -> str:
    return llm.chat_prompt([{"role": "user", "content": question}])


def constrained(kind, value, **kwargs) -> SamplingParams:
    return SamplingParams(
        **{"max_tokens": 40, "temperature": 0} | kwargs, structured=StructuredOutput(kind, value, "response_format")
    )


def check_person(text: str) -> None:
    person = json.loads(text)
    assert set(person) == {"name", "age"} and isinstance(person["age"], int) and len(person["name"]) <= 12


def test_json_schema_output_parses_and_validates_greedy_and_sampled(llm):
    prompt = chat(llm, "Describe a person as JSON.")
    plain = llm.generate([prompt], SamplingParams(max_tokens=40, temperature=0))[0]
    with pytest.raises(ValueError):  # the model left to itself does not answer with this JSON
        check_person(plain.text)
    outs = llm.generate(
        [prompt] * 3,
        [
            constrained("json", PERSON),
            constrained("json", PERSON, temperature=1.0, seed=1),
            constrained("json", PERSON, temperature=1.0, seed=2),
        ],
    )
    for out in outs:
        assert out.finish_reason == "stop", out.text
        check_person(out.text)


def test_regex_choice_and_grammar(llm):
    prompt = chat(llm, "What is your favourite number?")
    regex, choice, grammar = llm.generate(
        [prompt] * 3,
        [
            constrained("regex", r"[0-9]{3}-[a-z]{2}"),
            constrained("choice", ["red", "green", "blue"]),
            constrained("grammar", 'start: "yes" | "no" | "maybe " NUM\nNUM: /[0-9]/'),
        ],
    )
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", regex.text) and regex.finish_reason == "stop"
    assert choice.text in ("red", "green", "blue")
    assert re.fullmatch(r"yes|no|maybe [0-9]", grammar.text)


def test_unconstrained_rows_of_a_constrained_batch_are_unchanged(llm):
    prompt = chat(llm, "Name a colour.")
    free = SamplingParams(max_tokens=12, temperature=0)
    llm.generate([prompt], SamplingParams(max_tokens=1))  # both runs below then read the prompt from the cache
    both_free = llm.generate([prompt, prompt], [free, free])[0]  # the same batch shape, so the same rounding
    # A constraint that outlasts max_tokens keeps the batch at two rows to the end, as in the free run.
    mixed = llm.generate([prompt, prompt], [free, constrained("regex", "[a-z]{100}", max_tokens=12)])
    assert mixed[0].token_ids == both_free.token_ids
    assert re.fullmatch("[a-z]+", mixed[1].text) and mixed[1].finish_reason == "length"


def test_logprobs_are_the_models_raw_distribution(llm):
    """As vLLM's default (raw logprobs): the sampled token's logprob is the unconstrained model's, so the
    constrained first token's logprob equals its logprob in an unconstrained run's top list."""
    prompt = chat(llm, "Pick a colour.")
    llm.generate([prompt], SamplingParams(max_tokens=1))  # both rows below then read the prompt from the cache
    free, out = llm.generate(
        [prompt, prompt],
        [SamplingParams(max_tokens=1, temperature=0, logprobs=20), constrained("choice", ["green"], logprobs=5)],
    )
    first = out.logprobs[0]
    assert out.text == "green"
    assert first.top == free.logprobs[0].top[:5]
    assert first.logprob < -1e-3  # not renormalized over the allowed tokens (that would make it 0)


def test_max_tokens_cuts_a_constrained_output_with_length(llm):
    out = llm.generate([chat(llm, "Describe a person as JSON.")], constrained("json", PERSON, max_tokens=3))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 3


@pytest.mark.parametrize(
    "kind, value, words",
    [
        ("json", {"type": "object", "properties": {"a": {"not": {"type": "string"}}}}, "not"),
        ("json", {"type": "strin"}, "strin"),
        ("regex", "(a", "unclosed group"),
        ("grammar", "start: foo", "foo"),
    ],
)
def test_bad_constraint_fails_at_the_door_naming_the_field(llm, kind, value, words):
    with pytest.raises(ValueError, match=rf"^response_format: .*{words}"):
        llm.engine.request("bad", [1, 2, 3], constrained(kind, value))


def test_oversized_constraint_is_refused():
    with pytest.raises(ValueError, match=r"^guided_regex: .* at most"):
        StructuredOutput("regex", "a" * 70_000, "guided_regex")


def test_constrained_outputs_survive_preemption(llm):
    """Eight constrained requests: the same tokens alone and in a pool so small that they are preempted and
    recomputed (the grammar state follows the kept output tokens), and every finished one valid. Greedy, as in
    test_batching: a batch changes float rounding, which may flip a sampled near-tie."""
    from carpool import LLM

    prompts = [chat(llm, f"Describe person number {i} as JSON.") for i in range(8)]
    params = [constrained("json", PERSON) for _ in range(8)]
    alone = [llm.generate([p], q)[0] for p, q in zip(prompts, params)]
    small = LLM(dtype="float32", num_kv_blocks=12, max_num_seqs=8, enable_prefix_caching=False, matmul="exact")
    together = small.generate(prompts, params)
    assert sum(o.num_preemptions for o in together) > 0
    assert [o.token_ids for o in together] == [o.token_ids for o in alone]
    for out in together:
        if out.finish_reason == "stop":
            check_person(out.text)
    assert sum(o.finish_reason == "stop" for o in together) >= 6


def test_masks_filled_beside_the_forward_pass_give_the_same_tokens(llm, monkeypatch):
    """With a core to spare, each step's masks are filled on a worker thread during the forward pass, for the
    constrained rows wherever they sit in the batch: the same tokens as filled inline after it."""
    import threading

    from carpool.engine.structured import masks

    prompt = chat(llm, "Describe a person as JSON.")
    free = SamplingParams(max_tokens=16, temperature=0)
    params = [free, constrained("json", PERSON), free, constrained("regex", "[0-9]{3}-[a-z]{2}")]
    llm.generate([prompt], SamplingParams(max_tokens=1))  # both runs below then read the prompt from the cache
    monkeypatch.setattr(masks, "overlaps_forward", lambda: False)
    inline = llm.generate([prompt] * 4, params)
    fill, threads = masks.GrammarMasks.__init__, []

    def recording(self, *args):
        threads.append(threading.current_thread().name)
        fill(self, *args)

    monkeypatch.setattr(masks.GrammarMasks, "__init__", recording)
    monkeypatch.setattr(masks, "overlaps_forward", lambda: True)
    beside = llm.generate([prompt] * 4, params)
    assert [o.token_ids for o in beside] == [o.token_ids for o in inline]
    assert threads and all(name.startswith("carpool-grammar-masks") for name in threads)  # none refilled inline
    check_person(beside[1].text)
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", beside[3].text)
