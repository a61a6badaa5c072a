"""Automatic prefix caching: same outputs as without it, shared blocks by reference, exact block accounting."""

import pytest
import torch
from block_invariants import check_block_invariants, run_with_aborts

from carpool import LLM, SamplingParams
from carpool.bench.datasets import conversations, first_human_turns

REPLY = SamplingParams(max_tokens=8, temperature=0)


def replay(llm, chats, max_user_turns=2):
    """Replay conversations turn by turn, the model's own replies becoming the next turn's history."""
    histories = [[] for _ in chats]
    replies = []
    for turn in range(max_user_turns):
        active = [i for i, chat in enumerate(chats) if 2 * turn < len(chat)]
        for i in active:
            histories[i].append({"role": "user", "content": chats[i][2 * turn]["content"][:200]})
        prompts = [llm.chat_prompt(histories[i]) for i in active]
        outputs = llm.generate(prompts, REPLY)
        for i, output in zip(active, outputs):
            histories[i].append({"role": "assistant", "content": output.text})
            replies.append(output.token_ids)
    return replies, outputs


@pytest.fixture(scope="module")
def chats():
    every = list(conversations())
    multi_turn = [c for c in every if len(c) >= 4]
    return (multi_turn + [c for c in every if len(c) < 4])[:100]


def test_outputs_identical_with_cache_on_and_off_over_100_conversations(llm, chats):
    uncached = LLM(dtype="float32", max_num_seqs=32, enable_prefix_caching=False, matmul="exact")
    expected, _ = replay(uncached, chats)
    got, last_turn = replay(llm, chats)
    assert got == expected
    # The second turns re-sent their first turn's prompt and reply: most of it came from the cache.
    assert sum(o.num_cached_tokens for o in last_turn) > 0.5 * sum(o.num_prompt_tokens for o in last_turn)
    check_block_invariants(llm.engine)


def test_shared_prefix_is_shared_by_reference_and_isolated_by_salt(llm, tokenizer):
    engine = llm.engine
    system = "You are a meticulous assistant. " * 12
    prompts = [tokenizer.encode(system + f"Question {i}: what is {i} + {i}?") for i in range(3)]
    first = engine.add_request("a", prompts[0], REPLY, cache_salt="tenant-1")
    while first.num_computed_tokens < first.num_prompt_tokens:
        engine.step()
    same_tenant = engine.add_request("b", prompts[1], REPLY, cache_salt="tenant-1")
    other_tenant = engine.add_request("c", prompts[2], REPLY, cache_salt="tenant-2")
    engine.step()
    shared = first.block_table[: same_tenant.num_cached_prompt_tokens // engine.block_manager.block_size]
    assert same_tenant.num_cached_prompt_tokens >= len(tokenizer.encode(system)) - engine.block_manager.block_size
    assert same_tenant.block_table[: len(shared)] == shared  # the same physical blocks, not copies
    assert all(engine.block_manager.blocks[b].ref_count == 2 for b in shared)
    assert other_tenant.num_cached_prompt_tokens == 0
    while engine.has_unfinished_requests():
        engine.step()
        check_block_invariants(engine)


def test_a_prefix_ending_inside_a_block_is_copied_token_for_token(llm, tokenizer):
    """Blocks are hashed whole; the shared tokens after the last whole block (a system prompt's tail) come from a
    cached block that starts with them, copied into a block of the request's own, not computed again."""
    engine, bs = llm.engine, llm.engine.block_manager.block_size
    system = tokenizer.encode("You are a terse assistant who answers in one line. " * 3)
    shared = len(system) + 5
    assert shared % bs  # ends inside a block
    first_prompt = system + tokenizer.encode(" Question one: name a planet with rings, and say why it has them.")
    second_prompt = first_prompt[:shared] + tokenizer.encode(" What is the capital of France?")
    assert second_prompt[shared] != first_prompt[shared]
    assert len(first_prompt) >= (shared // bs + 1) * bs  # the block holding the shared end is whole, so cached
    first = engine.add_request("p1", first_prompt, REPLY, cache_salt="partial")
    while first.num_computed_tokens < first.num_prompt_tokens:
        engine.step()
    source = first.block_table[shared // bs]
    second = engine.add_request("p2", second_prompt, REPLY, cache_salt="partial")
    other_tenant = engine.add_request("p3", second_prompt, REPLY, cache_salt="partial-other")
    engine.step()
    assert second.num_cached_prompt_tokens == shared
    assert other_tenant.num_cached_prompt_tokens == 0
    own = second.block_table[shared // bs]
    assert own != source and engine.block_manager.blocks[source].ref_count == 1  # a copy, not a share
    kv = engine.runner.kv_cache
    assert torch.equal(kv[:, :, own, : shared % bs], kv[:, :, source, : shared % bs])
    outputs = {}
    while engine.has_unfinished_requests():
        outputs.update({o.request_id: o for o in engine.step()})
        check_block_invariants(engine)
    # what a cold engine computes from scratch, and billing: cached and newly cached tokens never overlap
    cold = LLM(dtype="float32", max_num_seqs=4, enable_prefix_caching=False, matmul="exact")
    assert outputs["p2"].token_ids == cold.generate([second_prompt], REPLY)[0].token_ids
    assert outputs["p2"].num_cached_tokens + second.num_cache_write_tokens <= len(second_prompt)


def test_waiting_requests_with_a_shared_uncached_prefix_let_one_compute_it(llm, tokenizer):
    engine = llm.engine
    system = "Answer in the style of a ship's log, with dates and bearings. " * 10
    for i in range(4):
        engine.add_request(f"s{i}", tokenizer.encode(system + f"Entry {i}."), REPLY, cache_salt="admission")
    engine.step()
    assert [s.request_id for s in engine.scheduler.running] == ["s0"]
    outputs = {}
    while engine.has_unfinished_requests():
        outputs.update({o.request_id: o for o in engine.step()})
    system_tokens = len(tokenizer.encode(system))
    for i in range(1, 4):
        assert outputs[f"s{i}"].num_cached_tokens >= system_tokens - engine.block_manager.block_size


def test_accounting_exact_under_eviction_preemption_and_abort(tokenizer):
    small = LLM(dtype="float32", num_kv_blocks=24, max_num_seqs=8, max_num_batched_tokens=96, matmul="exact")
    engine = small.engine
    base = "Shared context about the solar system and its planets. " * 4
    own = first_human_turns(12, max_chars=300)
    for i in range(12):
        prompt = tokenizer.encode(base * (1 + i % 2) + own[i])  # a shared head, then a tail of its own
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=30, temperature=0.7, seed=i))
    assert run_with_aborts(engine, {4: ["r3"]}) > 0  # preemptions happened
