"""Continuous batching must not change anyone's output: alone, together, chunked, or preempted."""

import pytest
from block_invariants import check_block_invariants, run_with_aborts

from carpool import LLM, SamplingParams
from carpool.bench.datasets import first_human_turns

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def prompts(tokenizer):
    # 32 real prompts of mixed lengths: chat-templated first turns, some cut short, some long.
    texts = first_human_turns(32, max_chars=1500)
    chats = [tokenizer.apply_chat_template([{"role": "user", "content": t}]) for t in texts]
    ids = [tokenizer.encode(c) for c in chats]
    return [p[: 8 + 7 * i] if i % 3 == 0 else p for i, p in enumerate(ids)]


@pytest.fixture(scope="module")
def alone(llm, prompts):
    return [llm.generate([p], GREEDY)[0].token_ids for p in prompts]


def assert_pool_empty(engine):
    assert not engine.scheduler.running and not engine.scheduler.waiting
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    check_block_invariants(engine)


def test_mixed_lengths_are_a_real_mix(prompts):
    lengths = sorted(map(len, prompts))
    assert lengths[0] < 40 and lengths[-1] > 200


def test_same_greedy_output_alone_and_together(llm, prompts, alone):
    together = [o.token_ids for o in llm.generate(prompts, GREEDY)]
    assert together == alone
    assert_pool_empty(llm.engine)


@pytest.fixture(scope="module")
def small_pool_llm():
    return LLM(
        dtype="float32",
        num_kv_blocks=40,
        max_num_seqs=32,
        max_num_batched_tokens=256,
        enable_prefix_caching=False,
        matmul="exact",
    )


def test_same_output_when_a_small_pool_forces_preemption(small_pool_llm, prompts, alone):
    short = [i for i, p in enumerate(prompts) if len(p) < 120]
    outputs = small_pool_llm.generate([prompts[i] for i in short], GREEDY)
    assert [o.token_ids for o in outputs] == [alone[i] for i in short]
    assert sum(o.num_preemptions for o in outputs) > 0
    assert_pool_empty(small_pool_llm.engine)


def test_chunked_prefill_shares_steps_with_decodes(llm, prompts, alone):
    engine = llm.engine
    long_prompt = max(prompts, key=len)
    budget = engine.config.max_num_batched_tokens
    engine.config.max_num_batched_tokens = 64
    engine.block_manager.enable_prefix_caching = False  # earlier tests cached this prompt: compute it all
    try:
        engine.add_request("stream", prompts[0], SamplingParams(max_tokens=100, temperature=0, ignore_eos=True))
        engine.step()
        engine.add_request("long", long_prompt, GREEDY)
        long_seq = engine.seqs["long"]
        prefill_steps, streamed = 0, 0
        while long_seq.num_computed_tokens < len(long_prompt):
            outputs = {o.request_id: o for o in engine.step()}
            assert engine.last_step.num_tokens <= 64
            prefill_steps += 1
            streamed += "stream" in outputs
        engine.abort("stream")
        while engine.has_unfinished_requests():
            outputs = {o.request_id: o for o in engine.step()}
    finally:
        engine.config.max_num_batched_tokens = budget
        engine.block_manager.enable_prefix_caching = True
    # The long prompt took many steps, and the other request got a token in every one of them.
    assert prefill_steps >= len(long_prompt) // 64
    assert streamed == prefill_steps
    assert outputs["long"].token_ids == alone[prompts.index(long_prompt)]
    assert_pool_empty(engine)


def test_new_request_joins_at_the_next_step(llm, prompts):
    engine = llm.engine
    engine.add_request("first", prompts[0], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
    engine.step()
    engine.step()
    engine.add_request("second", prompts[3], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
    engine.step()
    assert {s.request_id for s in engine.scheduler.running} == {"first", "second"}
    engine.abort("first")
    engine.abort("second")
    assert_pool_empty(engine)


def test_blocks_all_return_after_finish_abort_and_preemption(small_pool_llm, prompts):
    engine = small_pool_llm.engine
    for i, prompt in enumerate([p for p in prompts if len(p) < 200][:16]):
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=6 + i % 5, temperature=0.8, seed=i))
    assert run_with_aborts(engine, {3: ["r2", "r5"], 6: ["r9"]}) > 0  # preemptions happened
    assert_pool_empty(engine)
