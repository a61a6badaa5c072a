"""Per-request behaviour: bad input is refused without disturbing others; sampling options do what they say."""

import pytest

from carpool import SamplingParams

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


@pytest.mark.parametrize(
    "field, make",
    [
        ("prompt", lambda llm: llm.generate([""], GREEDY)),
        ("prompt", lambda llm: llm.generate([[]], GREEDY)),
        ("prompt", lambda llm: llm.generate([[1] * llm.engine.max_model_len], GREEDY)),
        ("prompt", lambda llm: llm.generate([[10**9]], GREEDY)),
        ("max_tokens", lambda llm: llm.generate(["hi"], SamplingParams(max_tokens=llm.engine.max_model_len))),
        ("max_tokens", lambda llm: SamplingParams(max_tokens=0)),
        ("max_tokens", lambda llm: SamplingParams(max_tokens=-3)),
        ("temperature", lambda llm: SamplingParams(temperature=-0.1)),
        ("top_p", lambda llm: SamplingParams(top_p=0)),
        ("top_p", lambda llm: SamplingParams(top_p=1.5)),
        ("top_k", lambda llm: SamplingParams(top_k=-1)),
        ("min_p", lambda llm: SamplingParams(min_p=2)),
        ("stop", lambda llm: SamplingParams(stop=42)),
        ("stop", lambda llm: SamplingParams(stop=["ok", 3])),
        ("logprobs", lambda llm: SamplingParams(logprobs=99)),
    ],
)
def test_bad_input_is_a_value_error_naming_the_field(llm, field, make):
    with pytest.raises(ValueError, match=field):
        make(llm)


def test_bad_request_leaves_the_engine_and_other_requests_running(llm, tokenizer):
    engine = llm.engine
    engine.add_request("good", "Count to ten:", GREEDY)
    engine.step()
    with pytest.raises(ValueError, match="prompt"):
        engine.add_request("bad", "", GREEDY)
    with pytest.raises(ValueError, match="prompt"):
        llm.generate(["fine", ""], GREEDY)  # the good half of a bad batch is withdrawn, not left behind
    outputs = {}
    while engine.has_unfinished_requests():
        outputs.update({o.request_id: o for o in engine.step()})
    assert set(outputs) == {"good"} and len(outputs["good"].token_ids) == 8
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_seeded_sampling_is_reproducible_alone_and_in_a_batch(llm):
    params = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, seed=1234)
    alone = llm.generate(["Write a haiku about rain."], params)[0].token_ids
    others = [SamplingParams(max_tokens=12, temperature=1.0, seed=s) for s in range(5)]
    batch = llm.generate(["Write a haiku about rain."] + ["Tell me a joke."] * 5, [params] + others)
    assert batch[0].token_ids == alone
    assert len({tuple(o.token_ids) for o in batch[1:]}) > 1  # different seeds, different samples


def test_top_k_one_and_tiny_top_p_are_greedy(llm):
    greedy = llm.generate(["The ocean is"], GREEDY)[0].token_ids
    for params in (
        SamplingParams(max_tokens=8, temperature=1.5, top_k=1, ignore_eos=True, seed=3),
        SamplingParams(max_tokens=8, temperature=1.5, top_p=1e-6, ignore_eos=True, seed=3),
        SamplingParams(max_tokens=8, temperature=1.5, min_p=1.0, ignore_eos=True, seed=3),
    ):
        assert llm.generate(["The ocean is"], params)[0].token_ids == greedy


def test_stop_strings_end_the_text_and_are_excluded(llm):
    full = llm.generate(["1, 2, 3, 4,"], SamplingParams(max_tokens=12, temperature=0))[0].text
    stop = full.strip().split(",")[1].strip()  # a number the model is about to write
    out = llm.generate(["1, 2, 3, 4,"], SamplingParams(max_tokens=12, temperature=0, stop=[stop]))[0]
    assert out.finish_reason == "stop"
    assert stop not in out.text and full.startswith(out.text)


def test_stop_token_ids_and_length(llm, tokenizer):
    greedy = llm.generate(["1, 2, 3, 4,"], GREEDY)[0].token_ids
    stop = greedy[2]
    out = llm.generate(["1, 2, 3, 4,"], SamplingParams(max_tokens=8, temperature=0, stop_token_ids=[stop]))[0]
    assert out.finish_reason == "stop" and out.token_ids == greedy[: greedy.index(stop) + 1]
    assert llm.generate(["1, 2, 3, 4,"], GREEDY)[0].finish_reason == "length"


def test_logprobs_of_sampled_and_top_tokens(llm):
    out = llm.generate(["The sky is"], SamplingParams(max_tokens=4, temperature=0, logprobs=3))[0]
    assert len(out.logprobs) == len(out.token_ids)
    for token, entry in zip(out.token_ids, out.logprobs):
        assert entry.token_id == token and entry.logprob <= 0
        assert len(entry.top) == 3 and entry.top[0][0] == token  # greedy picks the most likely token
        assert entry.top[0][1] == pytest.approx(entry.logprob)
        assert entry.top[0][1] >= entry.top[1][1] >= entry.top[2][1]


def test_abort_frees_the_blocks_at_once(llm):
    engine = llm.engine
    engine.add_request("long", "Tell me everything about the sea.", SamplingParams(max_tokens=200, ignore_eos=True))
    for _ in range(3):
        engine.step()
    assert engine.block_manager.num_free_blocks < engine.block_manager.num_blocks
    engine.abort("long")
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert not engine.has_unfinished_requests()
