"""Attention over the paged KV cache.

The model calls `PagedAttention(q, k, v)` per layer; everything about where the keys and values live (which
cache slots, which sequences, how much context each has) travels beside the model call in
`AttentionMetadata`, set once per step by the model runner.

Token layout of a step: decode tokens first (one per sequence, shortest context first), then each prefill
chunk as a contiguous run. On the CPU decodes read the pool in place (`torch.ops.carpool.paged_decode_attention`);
elsewhere they are gathered into padded SDPA calls, one per group of similar context lengths so that short
contexts are not padded to the longest. Prefill chunks run one SDPA call each, or, in a reproducible step
(a segment with `rows`, on the CPU), through the decode kernel with the chunk's rows as decode rows of
their sequence: a token's attention is then the same bits whether a prompt chunk or a decode step computes it,
whatever else the call holds (the kernel's rows are row-invariant: tests/kernels/test_prompt_rows_attention.py).

A sliding-window layer (`window` > 0, Gemma 3's local layers) lets each query see only its last `window` keys,
its own included, as Hugging Face's sliding mask does.
"""

from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

import carpool.kernels  # noqa: F401  (registers torch.ops.carpool)


@dataclass
class PrefillSegment:
    start: int  # first token of the chunk in the step's flat token list
    end: int
    context_len: int  # tokens of context the chunk attends to: earlier chunks + this one
    # Blocks holding that context; None when the chunk starts the sequence, in which case the chunk's own
    # keys are the whole context and a plain causal mask applies.
    context_blocks: torch.Tensor | None
    # In a reproducible step: the chunk's rows as decode rows (each its sequence's table, keys up to itself).
    rows: "DecodeGroup | None" = None


@dataclass
class DecodeGroup:
    start: int  # first decode token of the group in the step's flat token list
    end: int
    block_tables: torch.Tensor  # [group size, max_blocks], padded with any block id
    context_lens: torch.Tensor  # [group size] keys each sequence attends to, its new token included


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] cache slot each new key/value is written to
    decode_groups: list[DecodeGroup] = field(default_factory=list)
    prefills: list[PrefillSegment] = field(default_factory=list)
    # The sliding-window layers' own slots and tables when they have a KV pool of their own (see
    # BlockManager); None: every layer reads this metadata.
    sliding: "AttentionMetadata | None" = None


_current: AttentionMetadata | None = None


def prompt_rows(table: torch.Tensor, block_size: int, offset: int, start: int, n: int) -> DecodeGroup:
    """A prompt chunk's n tokens (positions start.. of the sequence whose block table is `table`; offset: the
    chunk's first token in the step) as decode rows: each reads the table up to the chunk's end and attends to the
    keys up to itself (the chunk's own are written before attention). A sliding table's placeholder blocks lie
    before every row's window: the kernel never reads them."""
    blocks = table[: (start + n + block_size - 1) // block_size]
    lengths = torch.arange(start + 1, start + n + 1, dtype=torch.long, device=table.device)
    return DecodeGroup(offset, offset + n, blocks.expand(n, -1).contiguous(), lengths)


@contextmanager
def attention_metadata(metadata: AttentionMetadata):
    global _current
    previous, _current = _current, metadata
    try:
        yield
    finally:
        _current = previous


def decode_only_metadata(num_tokens: int) -> AttentionMetadata | None:
    """The current step's metadata when its `num_tokens` tokens are all decodes in one group (as the model runner
    groups them on the CPU), in the sliding group too; None otherwise. Such a step can run as one fused call."""

    def one_group(meta: AttentionMetadata) -> bool:
        groups = meta.decode_groups
        return not meta.prefills and len(groups) == 1 and groups[0].start == 0 and groups[0].end == num_tokens

    meta = _current
    if meta is None or not one_group(meta) or (meta.sliding is not None and not one_group(meta.sliding)):
        return None
    return meta


class PagedAttention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float | None = None, window: int = 0):
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5 if scale is None else scale
        self.window = window  # keys each query sees, counting back from itself; 0 = all
        # Views into the engine's KV pool, bound by the model runner: [num_blocks, block_size, kv_heads, head_dim].
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None

    def _gather(self, cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
        """[..., n_blocks] block ids -> [..., n_blocks * block_size, kv_heads, head_dim]; whole blocks are copied,
        which is several times faster than gathering token by token."""
        blocks = cache.index_select(0, block_ids.reshape(-1))
        return blocks.view(*block_ids.shape[:-1], -1, self.num_kv_heads, self.head_dim)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: [T, num_heads, head_dim]; k, v: [T, num_kv_heads, head_dim] -> [T, num_heads * head_dim]."""
        meta = _current
        if self.window and meta.sliding is not None:
            meta = meta.sliding
        if q.device.type == "cpu":
            torch.ops.carpool.write_kv_cache(k, v, self.k_cache, self.v_cache, meta.slot_mapping)
        else:
            self.k_cache.view(-1, self.num_kv_heads, self.head_dim).index_copy_(0, meta.slot_mapping, k)
            self.v_cache.view(-1, self.num_kv_heads, self.head_dim).index_copy_(0, meta.slot_mapping, v)
        out = torch.empty_like(q)
        for group in meta.decode_groups:
            out[group.start : group.end] = self._decode(q[group.start : group.end], group)
        for segment in meta.prefills:
            if segment.rows is not None:  # SDPA's blocked softmax would give the rows other bits than decoding does
                out[segment.start : segment.end] = self._decode(q[segment.start : segment.end], segment.rows)
            else:
                out[segment.start : segment.end] = self._prefill(q, k, v, segment)
        return out.view(q.shape[0], -1)

    def _decode(self, q: torch.Tensor, group: DecodeGroup) -> torch.Tensor:
        if q.device.type == "cpu":
            return torch.ops.carpool.paged_decode_attention(
                q, self.k_cache, self.v_cache, group.block_tables, group.context_lens, self.scale, self.window
            )
        return self._decode_gathered(q, group)

    def _decode_gathered(self, q: torch.Tensor, group: DecodeGroup) -> torch.Tensor:
        """The device-agnostic path: gather the group's blocks into padded copies, one masked SDPA call."""
        # Grouped-query trick: fold the query heads that share a KV head into the query-length axis,
        # so one batched matmul serves all of them without repeating keys.
        batch = q.shape[0]
        q = q.view(batch, self.num_kv_heads, self.num_heads // self.num_kv_heads, self.head_dim)
        keys = self._gather(self.k_cache, group.block_tables).transpose(1, 2)  # [B, kv_heads, ctx, d]
        values = self._gather(self.v_cache, group.block_tables).transpose(1, 2)
        positions = torch.arange(keys.shape[2], device=q.device)
        lengths = group.context_lens.unsqueeze(1)
        mask = positions < lengths
        if self.window:
            mask &= positions >= lengths - self.window
        mask = mask.view(batch, 1, 1, -1)
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=self.scale)
        return out.reshape(batch, self.num_heads, self.head_dim)

    def _prefill(self, q, k, v, segment: PrefillSegment) -> torch.Tensor:
        q = q[segment.start : segment.end].transpose(0, 1).unsqueeze(0)  # [1, heads, chunk, d]
        chunk, context = segment.end - segment.start, segment.context_len
        if segment.context_blocks is None:
            keys = k[segment.start : segment.end]
            values = v[segment.start : segment.end]
        else:
            keys = self._gather(self.k_cache, segment.context_blocks)[:context]
            values = self._gather(self.v_cache, segment.context_blocks)[:context]
        mask = self._prefill_mask(chunk, context, q.device)
        keys = keys.transpose(0, 1).unsqueeze(0)
        values = values.transpose(0, 1).unsqueeze(0)
        out = F.scaled_dot_product_attention(
            q, keys, values, attn_mask=mask, is_causal=mask is None, scale=self.scale, enable_gqa=True
        )
        return out.squeeze(0).transpose(0, 1)

    def _prefill_mask(self, chunk: int, context: int, device: torch.device) -> torch.Tensor | None:
        """[chunk, context]: query i sits at context position (context - chunk + i) and sees the keys up to it,
        and within the window only the last `window` of them. None: a plain causal mask does (the chunk is the
        whole context and no window cuts it)."""
        windowed = self.window and context > self.window
        if chunk == context and not windowed:
            return None
        ones = torch.ones(chunk, context, dtype=torch.bool, device=device)
        mask = ones.tril(diagonal=context - chunk)
        if windowed:
            mask &= ones.triu(diagonal=context - chunk - self.window + 1)
        return mask
