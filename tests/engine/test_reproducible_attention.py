"""In a reproducible step a prompt token's attention is the same bits as the token's attention computed as a decode
row (what a decode step, a recompute after preemption, or a later chunk would compute for it), whichever chunk it
was in: a chunk that starts its sequence, a chunk behind a prefix-cache hit, chunks of two sequences in one step.

Only attention is under test: the layers' own q/k/v of the prompt step are recorded at the PagedAttention module
(the engine's real KV pool, block tables and metadata) and replayed row by row as decodes of the same layer, so the
matmuls (batch-dependent in the session model's exact fp32 mode) play no part."""

import pytest
import torch

from carpool import LLM, SamplingParams
from carpool.models import attention
from carpool.models.attention import AttentionMetadata, DecodeGroup

FIRST_TOKEN = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)


@pytest.fixture
def reproducible_llm(llm):
    """The session model with its runner making reproducible steps (the engine's `reproducible` setting)."""
    runner = llm.engine.runner
    before, runner.reproducible = runner.reproducible, True
    yield llm
    runner.reproducible = before


def replay_chunks(layer_attention):
    """Hooks the layer's attention: each prefill chunk it runs is replayed at once (on the pool as the chunk left
    it), its rows attended one by one as decode rows of their sequence and then all as one decode group; appended
    as (first position, the chunk's output, one by one, together)."""
    replays = []

    def hook(module, inputs, out):
        q, k, v = inputs
        full = attention._current
        meta = full.sliding if module.window and full.sliding is not None else full
        block_size = module.k_cache.shape[1]
        for segment, full_segment in zip(meta.prefills, full.prefills):
            rows = slice(segment.start, segment.end)
            slots = meta.slot_mapping[rows]
            first = full_segment.context_len - (segment.end - segment.start)  # full attention: keys from 0
            if segment.context_blocks is None:  # the chunk starts its sequence: its slots name its blocks
                table = slots[::block_size] // block_size
            else:  # a window's blocks from its first key's on; any block id stands for those before
                skipped = (first + segment.end - segment.start - segment.context_len) // block_size
                table = torch.cat([torch.zeros(skipped, dtype=torch.long), segment.context_blocks])
            one_by_one, together = replay_as_decodes(module, q[rows], k[rows], v[rows], table, first, slots)
            replays.append((first, out[rows], one_by_one, together))

    return replays, layer_attention.register_forward_hook(hook)


def replay_as_decodes(layer_attention, q, k, v, table, first, slots):
    lengths = torch.arange(first + 1, first + q.shape[0] + 1)
    one_by_one = []
    for i in range(q.shape[0]):
        meta = AttentionMetadata(slots[i : i + 1], [DecodeGroup(0, 1, table[None], lengths[i : i + 1])])
        with attention.attention_metadata(meta):
            one_by_one.append(layer_attention(q[i : i + 1], k[i : i + 1], v[i : i + 1]))
    together = AttentionMetadata(slots, [DecodeGroup(0, q.shape[0], table.expand(q.shape[0], -1), lengths)])
    with attention.attention_metadata(together):
        return torch.cat(one_by_one), layer_attention(q, k, v)


def prefill_replays(llm, layer_indices, prompts_in_turn):
    """Each of `prompts_in_turn` (lists of prompts) generated in turn (one token each), the chunks of the layers'
    attention replayed; per layer, its replays."""
    layers = [llm.engine.model.layers[i].self_attn.attn for i in layer_indices]
    hooked = [replay_chunks(layer) for layer in layers]
    try:
        for prompts in prompts_in_turn:
            llm.generate(prompts, FIRST_TOKEN)
    finally:
        for _, handle in hooked:
            handle.remove()
    return [replays for replays, _ in hooked]


def assert_rows_equal(replays):
    for _, out, one_by_one, together in replays:
        assert torch.equal(one_by_one, out)
        assert torch.equal(together, out)


def test_prompt_rows_attend_as_decode_rows(reproducible_llm):
    block_size = reproducible_llm.engine.config.block_size
    shared = [100 + i * 7 % 997 for i in range(6 * block_size + 5)]
    # A chunk from position 0; then the shared prompt's whole blocks from the prefix cache and its tail: a chunk
    # behind 96 cached keys, in one step with another prompt's first chunk.
    turns = [[shared], [shared + [7, 8, 9] * 20, [300 + i for i in range(40)]]]
    for replays in prefill_replays(reproducible_llm, (0, -1), turns):
        assert sorted(first for first, *_ in replays) == [0, 0, 6 * block_size]
        assert_rows_equal(replays)


def test_sliding_window_prompt_rows_attend_as_decode_rows():
    """Gemma 3's local layers (a 512-key window, a pool of their own) and a global one, over a prompt of three
    512-token chunks: the last chunk's rows see windows that start past the sequence's first 32 blocks."""
    llm = LLM(model="gemma-3-270m", dtype="float32", quantization="none", max_num_seqs=2, num_kv_blocks=160)
    llm.engine.runner.reproducible = True
    config = llm.engine.model.config
    assert config.layer_window(0) == 512 and not config.layer_window(5)
    for replays in prefill_replays(llm, (0, 5), [[[100 + i * 7 % 9973 for i in range(1100)]]]):
        assert [first for first, *_ in replays] == [0, 512, 1024]
        assert_rows_equal(replays)
