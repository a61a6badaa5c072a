"""Turns a scheduled batch into one forward pass: flat token ids and positions, cache slots, attention
metadata, and logits only for the sequences that will sample."""

import torch

from carpool.engine.attention import AttentionMetadata, PrefillSegment, attention_metadata
from carpool.engine.scheduler import ScheduledBatch
from carpool.engine.sequence import Sequence


class ModelRunner:
    def __init__(self, model, num_blocks: int, block_size: int, device: torch.device):
        self.model = model
        self.block_size = block_size
        self.device = device
        config = model.config
        # One pool for all layers: [layers, k/v, slots, kv_heads, head_dim], left uninitialised (touching
        # a GiB costs a second at start). Padded attention positions read the extra last slot instead,
        # which is zeroed: masked-out garbage could still be NaN, and NaN * 0 poisons the sum.
        self.null_slot = num_blocks * block_size
        self.kv_cache = torch.empty(
            config.num_layers, 2, self.null_slot + 1, config.num_kv_heads, config.head_dim,
            dtype=torch.float32, device=device,
        )
        self.kv_cache[:, :, self.null_slot].zero_()
        for i, layer in enumerate(model.layers):
            layer.self_attn.attn.k_cache = self.kv_cache[i, 0]
            layer.self_attn.attn.v_cache = self.kv_cache[i, 1]

    @staticmethod
    def kv_bytes_per_block(config, block_size: int) -> int:
        return config.num_layers * 2 * block_size * config.num_kv_heads * config.head_dim * 4

    def _slots(self, seq: Sequence, start: int, end: int) -> torch.Tensor:
        positions = torch.arange(start, end)
        table = torch.tensor(seq.block_table, dtype=torch.long)
        return table[positions // self.block_size] * self.block_size + positions % self.block_size

    def run(self, batch: ScheduledBatch) -> tuple[torch.Tensor | None, list[Sequence]]:
        """Forward the batch; returns logits [n, vocab] for the sequences that reached their last token."""
        order = sorted(range(len(batch.seqs)), key=lambda i: batch.num_new_tokens[i] != 1)
        input_ids, positions, slots, sampled_rows, sampling = [], [], [], [], []
        decode_seqs, prefills = [], []
        offset = 0
        for i in order:
            seq, n = batch.seqs[i], batch.num_new_tokens[i]
            start = seq.num_computed_tokens
            input_ids.extend(seq.token_ids[start : start + n])
            positions.extend(range(start, start + n))
            slots.append(self._slots(seq, start, start + n))
            if n == 1:
                decode_seqs.append(seq)
            else:
                context = self._slots(seq, 0, start + n) if start else None
                prefills.append(PrefillSegment(offset, offset + n, context))
            offset += n
            if start + n == seq.num_tokens:
                sampled_rows.append(offset - 1)
                sampling.append(seq)
        metadata = AttentionMetadata(slot_mapping=torch.cat(slots), num_decode_tokens=len(decode_seqs), prefills=prefills)
        if decode_seqs:
            metadata.decode_context_slots, metadata.decode_mask = self._decode_context(decode_seqs)
        to_device = lambda t: t.to(self.device, non_blocking=True)  # noqa: E731
        metadata.slot_mapping = to_device(metadata.slot_mapping)
        for segment in prefills:
            if segment.context_slots is not None:
                segment.context_slots = to_device(segment.context_slots)
        with attention_metadata(metadata):
            hidden = self.model(
                torch.tensor(input_ids, dtype=torch.long, device=self.device),
                torch.tensor(positions, dtype=torch.long, device=self.device),
            )
        if not sampling:
            return None, []
        rows = torch.tensor(sampled_rows, dtype=torch.long, device=self.device)
        return self.model.compute_logits(hidden[rows]), sampling

    def _decode_context(self, seqs: list[Sequence]) -> tuple[torch.Tensor, torch.Tensor]:
        lengths = torch.tensor([s.num_computed_tokens + 1 for s in seqs])
        max_len = int(lengths.max())
        max_blocks = -(-max_len // self.block_size)
        tables = torch.zeros(len(seqs), max_blocks, dtype=torch.long)
        for row, seq in enumerate(seqs):
            table = seq.block_table[:max_blocks]
            tables[row, : len(table)] = torch.tensor(table, dtype=torch.long)
        positions = torch.arange(max_len)
        slots = tables[:, positions // self.block_size] * self.block_size + positions % self.block_size
        valid = positions.unsqueeze(0) < lengths.unsqueeze(1)
        slots = slots.masked_fill(~valid, self.null_slot)
        return slots.to(self.device), valid.view(len(seqs), 1, 1, max_len).to(self.device)
