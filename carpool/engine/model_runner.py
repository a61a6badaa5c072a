"""Turns a scheduled batch into one forward pass: flat token ids and positions, cache slots, attention
metadata, and logits only for the sequences that will sample."""

import math
import mmap

import torch

from carpool.engine.attention import AttentionMetadata, DecodeGroup, PrefillSegment, attention_metadata
from carpool.engine.scheduler import ScheduledBatch
from carpool.engine.sequence import Sequence


def _zeroed_pool(shape: tuple[int, ...], device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """A zero-filled KV pool. On the CPU it is backed by anonymous mmap, whose pages the kernel zeroes on
    first touch: a GiB pool costs nothing at start instead of a second of memset."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = dtype.itemsize * math.prod(shape)
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=dtype).view(shape)


class ModelRunner:
    def __init__(self, model, num_blocks: int, block_size: int, device: torch.device, dtype: torch.dtype):
        self.model = model
        self.block_size = block_size
        self.device = device
        config = model.config
        # One pool for all layers: [layers, k/v, blocks, block_size, kv_heads, head_dim]. It must start zeroed:
        # padded attention positions read unused slots, and masked-out NaN garbage would still poison the sum.
        self.kv_cache = _zeroed_pool(
            (config.num_layers, 2, num_blocks, block_size, config.num_kv_heads, config.head_dim), device, dtype
        )
        for i, layer in enumerate(model.layers):
            layer.self_attn.attn.k_cache = self.kv_cache[i, 0]
            layer.self_attn.attn.v_cache = self.kv_cache[i, 1]

    @staticmethod
    def kv_bytes_per_block(config, block_size: int, dtype: torch.dtype = torch.float32) -> int:
        return config.num_layers * 2 * block_size * config.num_kv_heads * config.head_dim * dtype.itemsize

    def _slots(self, seq: Sequence, start: int, end: int) -> torch.Tensor:
        positions = torch.arange(start, end)
        table = torch.tensor(seq.block_table, dtype=torch.long)
        return table[positions // self.block_size] * self.block_size + positions % self.block_size

    def run(self, batch: ScheduledBatch) -> tuple[torch.Tensor | None, list[Sequence]]:
        """Forward the batch; returns logits [n, vocab] for the sequences that reached their last token."""
        order = sorted(
            range(len(batch.seqs)), key=lambda i: (batch.num_new_tokens[i] != 1, batch.seqs[i].num_computed_tokens)
        )
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
                blocks = None
                if start:
                    num_blocks = -(-(start + n) // self.block_size)
                    blocks = torch.tensor(seq.block_table[:num_blocks], dtype=torch.long, device=self.device)
                prefills.append(PrefillSegment(offset, offset + n, start + n, blocks))
            offset += n
            if start + n == seq.num_tokens:
                sampled_rows.append(offset - 1)
                sampling.append(seq)
        metadata = AttentionMetadata(
            slot_mapping=torch.cat(slots).to(self.device), decode_groups=self._decode_groups(decode_seqs),
            prefills=prefills,
        )
        with attention_metadata(metadata):
            hidden = self.model(
                torch.tensor(input_ids, dtype=torch.long, device=self.device),
                torch.tensor(positions, dtype=torch.long, device=self.device),
            )
        if not sampling:
            return None, []
        rows = torch.tensor(sampled_rows, dtype=torch.long, device=self.device)
        return self.model.compute_logits(hidden[rows]), sampling

    def _decode_groups(self, seqs: list[Sequence]) -> list[DecodeGroup]:
        """On the CPU all decodes go in one group: its kernel walks each block table in place. Elsewhere the
        decodes (sorted by context length) split where the length doubles: the gathered, padded path would
        otherwise copy several times the KV that attention needs."""
        if self.device.type == "cpu":
            return [DecodeGroup(0, len(seqs), *self._decode_tables(seqs))] if seqs else []
        groups, start = [], 0
        for i in range(1, len(seqs) + 1):
            if i == len(seqs) or seqs[i].num_computed_tokens > 2 * seqs[start].num_computed_tokens + self.block_size:
                groups.append(DecodeGroup(start, i, *self._decode_tables(seqs[start:i])))
                start = i
        return groups

    def _decode_tables(self, seqs: list[Sequence]) -> tuple[torch.Tensor, torch.Tensor]:
        lengths = torch.tensor([s.num_computed_tokens + 1 for s in seqs])
        max_blocks = -(-int(lengths.max()) // self.block_size)
        tables = torch.zeros(len(seqs), max_blocks, dtype=torch.long)
        for row, seq in enumerate(seqs):
            table = seq.block_table[:max_blocks]
            tables[row, : len(table)] = torch.tensor(table, dtype=torch.long)
        return tables.to(self.device), lengths.to(self.device)
