"""Issue 53, reproducible by default: on the default settings a greedy or seeded request gives the same tokens
alone, in a batch of 32 mixed lengths, after a prefix-cache hit (whole blocks and a partial block), across chunked
prefill boundaries, under preemption and with n-gram and draft-model speculation. Every comparison is against the
request computed alone by an engine without a prefix cache. Runs on whatever kernel build is loaded
(test_reproducible_paths.py runs it on every other path this CPU can run)."""

import pytest
from block_invariants import check_block_invariants
from test_spec_decode import counting

from carpool import LLM, SamplingParams
from carpool.bench.datasets import first_human_turns

GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)


def seeded(seed: int) -> SamplingParams:
    return SamplingParams(max_tokens=10, temperature=1.0, seed=seed, ignore_eos=True)


@pytest.fixture(scope="module")
def cold():
    """The defaults without a prefix cache: each reference computes its whole prompt, alone."""
    return LLM(max_num_seqs=32, enable_prefix_caching=False)


@pytest.fixture(scope="module")
def llm():
    """The defaults, as `carpool serve` runs them."""
    return LLM(max_num_seqs=32)


@pytest.fixture(scope="module")
def prompts(cold):
    """32 real prompts of mixed lengths (8 to ~400 tokens): chat-templated first turns, some cut short."""
    tokenizer = cold.tokenizer
    texts = first_human_turns(32, max_chars=1500)
    ids = [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": t}])) for t in texts]
    return [p[: 8 + 5 * i] if i % 3 == 0 else p for i, p in enumerate(ids)]


def alone(cold: LLM, prompt: list[int], params: SamplingParams) -> list[int]:
    return cold.generate([prompt], params)[0].token_ids


class Alone:
    """Each prompt's tokens computed alone, on first use: the prefix cases read 4 of the 32, and on the portable
    path (plain C, test_reproducible_paths.py) computing all 64 references took it most of 3 minutes."""

    def __init__(self, cold: LLM, prompts: list[list[int]], params):
        self.cold, self.prompts, self.params, self.tokens = cold, prompts, params, {}

    def __getitem__(self, i: int) -> list[int]:
        if i not in self.tokens:
            self.tokens[i] = alone(self.cold, self.prompts[i], self.params(i))
        return self.tokens[i]

    def every(self) -> list[list[int]]:
        return [self[i] for i in range(len(self.prompts))]


@pytest.fixture(scope="module")
def greedy_alone(cold, prompts):
    return Alone(cold, prompts, lambda i: GREEDY)


@pytest.fixture(scope="module")
def seeded_alone(cold, prompts):
    return Alone(cold, prompts, seeded)


def test_the_defaults_are_reproducible(llm):
    assert llm.engine.config.reproducible is True
    assert llm.engine.config.matmul == "int8-dot-all"


def test_a_batch_of_32_mixed_lengths_gives_each_request_its_tokens_alone(llm, prompts, greedy_alone, seeded_alone):
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == greedy_alone.every()
    params = [seeded(i) for i in range(len(prompts))]
    assert [o.token_ids for o in llm.generate(prompts, params)] == seeded_alone.every()


def test_a_prefix_cache_hit_changes_no_token(llm, cold, prompts, greedy_alone, seeded_alone):
    """Whole cached blocks (each of the 4 longest prompts again, its first run having cached it), and a partial
    block's copy (a prompt sharing a cached prompt's first tokens up to the middle of a block). Four, not eight:
    the portable path (test_reproducible_paths.py) took 3 minutes over eight."""
    longest = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))[-4:]
    llm.generate([prompts[i] for i in longest], GREEDY)
    for i in longest:
        again = llm.generate([prompts[i]], GREEDY)[0]
        assert again.num_cached_tokens >= len(prompts[i]) // 16 * 16 - 16
        assert again.token_ids == greedy_alone[i]
        assert llm.generate([prompts[i]], seeded(i))[0].token_ids == seeded_alone[i]
    block = llm.engine.config.block_size
    long = prompts[longest[-1]]
    fork = long[: 5 * block + block // 2] + long[-20:]
    out = llm.generate([fork], GREEDY)[0]
    assert out.num_cached_tokens == 5 * block + block // 2
    assert out.token_ids == alone(cold, fork, GREEDY)


def test_chunk_boundaries_change_no_token(cold, prompts, greedy_alone):
    """All 32 at once under a 37-token step budget: prompts cut into chunks at odd places, beside decodes."""
    budget = cold.engine.config.max_num_batched_tokens
    cold.engine.config.max_num_batched_tokens = 37
    try:
        outputs = cold.generate(prompts, GREEDY)
    finally:
        cold.engine.config.max_num_batched_tokens = budget
    assert [o.token_ids for o in outputs] == greedy_alone.every()


def test_preemption_with_recompute_changes_no_token(prompts, greedy_alone):
    small = LLM(num_kv_blocks=40, max_num_seqs=32, max_num_batched_tokens=256, enable_prefix_caching=False)
    short = [i for i, p in enumerate(prompts) if len(p) < 120]
    outputs = small.generate([prompts[i] for i in short], GREEDY)
    assert sum(o.num_preemptions for o in outputs) > 0
    assert [o.token_ids for o in outputs] == [greedy_alone[i] for i in short]
    check_block_invariants(small.engine)


def speculative(drafter: str) -> LLM:
    """An engine that always verifies 3 drafts (the policy would turn a 135M model drafting for itself off)."""
    llm = LLM(speculative_model=drafter, num_speculative_tokens=3, max_num_seqs=32)
    llm.engine.speculator.policy.num_drafts = lambda batch_size: 3
    return llm


def test_ngram_speculation_changes_no_token(prompts, greedy_alone, seeded_alone):
    """Verify rows (a sequence's last token and its drafts) through the same arithmetic as a decode row; the
    n-gram drafts are point masses, so seeded sampling keeps the plain sampler's draws."""
    llm = speculative("ngram")
    some = range(0, 32, 3)
    assert [o.token_ids for o in llm.generate([prompts[i] for i in some], GREEDY)] == [greedy_alone[i] for i in some]
    outputs = llm.generate([prompts[i] for i in some], [seeded(i) for i in some])
    assert [o.token_ids for o in outputs] == [seeded_alone[i] for i in some]


def test_draft_model_speculation_changes_no_token(prompts, greedy_alone, seeded_alone):
    """SmolLM2 drafting for itself, 11 prompts of mixed lengths at once. Sampled drafts race on the target's own
    seeded stream and are kept while they equal the target's sample: a seeded request's tokens are those decoding
    without speculation gives. The draft computes what the target does, bit for bit, so every draft lands (main
    drafted each sequence of a batch from another's logits and kept 4 of 312)."""
    llm = speculative("smollm2-135m")
    some = list(range(1, 32, 3))
    totals = counting(llm)
    assert [o.token_ids for o in llm.generate([prompts[i] for i in some], GREEDY)] == [greedy_alone[i] for i in some]
    outputs = llm.generate([prompts[i] for i in some], [seeded(i) for i in some])
    assert [o.token_ids for o in outputs] == [seeded_alone[i] for i in some]
    assert totals["accepted"] == totals["draft"] > 0
