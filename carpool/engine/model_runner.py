"""Turns a scheduled batch into one forward pass: flat token ids and positions, cache slots, attention
metadata, and logits only for the sequences that will sample."""

import ctypes
import math
import mmap

import torch

from carpool.engine.block_manager import cdiv
from carpool.engine.scheduler import ScheduledBatch
from carpool.engine.sequence import Sequence, TokenLogprob
from carpool.models.attention import AttentionMetadata, DecodeGroup, PrefillSegment, attention_metadata, prompt_rows

PROMPT_LOGPROB_ROWS = 64


def _zeroed_pool(shape: tuple[int, ...], device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """A zero-filled KV pool. On the CPU it is backed by private anonymous mmap, whose pages the kernel zeroes on
    first touch: a GiB pool costs nothing at start instead of a second of memset (MAP_POPULATE: 1.6 s). Private,
    not mmap's default MAP_SHARED: shared anonymous memory is tmpfs, whose first-touch faults cost ~14 us each inside
    the engine; the 1.5B's 32-sequence step (forced avx2, Intel) spent 6 ms of ~340 in write_kv_cache's faults,
    1.02-1.03x the step."""
    nbytes = dtype.itemsize * math.prod(shape)
    if device.type != "cpu" or nbytes == 0:  # mmap cannot map 0 bytes (a group without layers)
        return torch.zeros(shape, dtype=dtype, device=device)
    mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(mapping, dtype=dtype).view(shape)


def resident_bytes(pool: torch.Tensor) -> int:
    """How much of a pool is backed by memory now: all of it on an accelerator, the pages touched so far of a CPU
    pool (mincore(2) on its mapping). With the prefix cache's LRU free list every block is used in turn, so a
    server's RSS grows by its pools over the first minutes of slow traffic (a 40-minute soak: +2 GB for two 1 GB
    pools, then flat); this is how to tell that growth from a leak."""
    nbytes = pool.numel() * pool.element_size()
    if pool.device.type != "cpu" or nbytes == 0 or _mincore is None:
        return nbytes
    pages = -(-nbytes // mmap.PAGESIZE)
    present = (ctypes.c_ubyte * pages)()
    if _mincore(ctypes.c_void_p(pool.data_ptr()), ctypes.c_size_t(nbytes), present) != 0:
        return nbytes  # not a mapping of its own (a zeroed tensor): count it whole
    return int(torch.frombuffer(present, dtype=torch.uint8).bitwise_and(1).sum()) * mmap.PAGESIZE


def _libc_mincore():
    try:
        return ctypes.CDLL(None, use_errno=True).mincore
    except (OSError, AttributeError):  # not a POSIX libc
        return None


_mincore = _libc_mincore()


class ModelRunner:
    def __init__(
        self,
        model,
        num_blocks: int,
        block_size: int,
        device: torch.device,
        dtype: torch.dtype,
        sliding_window: int = 0,
        num_sliding_blocks: int | None = None,
        reproducible: bool = False,
    ):
        self.model = model
        # Prompt chunks attend as decode rows (PrefillSegment.rows): a token's bits whatever its step.
        self.reproducible = reproducible
        self.block_size = block_size
        self.device = device
        self.sliding_window = sliding_window  # > 0: sliding layers have a pool and block tables of their own
        config = model.config
        # A pool per KV cache group: [layers, k/v, blocks, block_size, kv_heads, head_dim]. It must start zeroed:
        # padded attention positions read unused slots, and masked-out NaN garbage would still poison the sum.
        # The sliding group's pool (carpool.engine.kv_pools sizes it) has one more block, its placeholder for
        # keys out of the window.
        sliding = [bool(sliding_window and config.layer_window(i)) for i in range(config.num_layers)]
        blocks = {False: num_blocks, True: (num_blocks if num_sliding_blocks is None else num_sliding_blocks) + 1}
        pools = {
            group: _zeroed_pool(
                (sliding.count(group), 2, blocks[group], block_size, config.num_kv_heads, config.head_dim),
                device,
                dtype,
            )
            for group in (False, True)
        }
        self.kv_cache, self.sliding_kv_cache = pools[False], pools[True]
        self.kv_pool_bytes = sum(pool.numel() * pool.element_size() for pool in pools.values())
        index_in_group = {False: 0, True: 0}
        for layer, is_sliding in zip(model.layers, sliding):
            cache = pools[is_sliding][index_in_group[is_sliding]]
            index_in_group[is_sliding] += 1
            layer.self_attn.attn.k_cache, layer.self_attn.attn.v_cache = cache[0], cache[1]

    def kv_resident_bytes(self) -> int:
        """Bytes of this runner's KV pools backed by memory now (`resident_bytes`)."""
        return resident_bytes(self.kv_cache) + resident_bytes(self.sliding_kv_cache)

    @staticmethod
    def kv_bytes_per_block(config, block_size: int, dtype: torch.dtype = torch.float32) -> int:
        return config.num_layers * 2 * block_size * config.num_kv_heads * config.head_dim * dtype.itemsize

    def _slots(self, table: list[int], start: int, end: int) -> list[int]:
        # Python ints: a decode's one slot cost 5 tensor ops (arange, tensor, index...) as tensors.
        size = self.block_size
        return [table[p // size] * size + p % size for p in range(start, end)]

    def run(self, batch: ScheduledBatch) -> tuple[torch.Tensor | None, list[Sequence]]:
        """Forward the batch; returns logits for the sequences that reached their last token: one row each, or
        1 + len(spec_token_ids) rows for a sequence verifying drafts, in the order of the returned list."""
        for source, target, num_tokens in batch.kv_copies.values():  # partial prefix hits (BlockManager.partial_hit)
            self.kv_cache[:, :, target, :num_tokens] = self.kv_cache[:, :, source, :num_tokens]
        order = sorted(
            range(len(batch.seqs)),
            key=lambda i: (not _decoding(batch.seqs[i], batch.num_new_tokens[i]), batch.seqs[i].num_computed_tokens),
        )
        input_ids, positions, sampled_rows, sampling = [], [], [], []
        runs = []  # (seq, offset in the step's tokens, new tokens)
        offset = 0
        for i in order:
            seq, n = batch.seqs[i], batch.num_new_tokens[i]
            start = seq.num_computed_tokens
            # A sequence's speculative drafts follow its last token; each of them, and the token before them,
            # gets a logits row (the verifier samples every position).
            input_ids.extend((seq.token_ids[start:] + seq.spec_token_ids)[:n])
            positions.extend(range(start, start + n))
            runs.append((seq, offset, n))
            offset += n
            if start + n == seq.num_tokens + len(seq.spec_token_ids):
                sampled_rows.extend(range(offset - 1 - len(seq.spec_token_ids), offset))
                sampling.append(seq)
        metadata = self._metadata(runs, lambda seq: seq.block_table, window=0)
        if self.sliding_window:
            metadata.sliding = self._metadata(runs, lambda seq: seq.sliding_block_table, self.sliding_window)
        with attention_metadata(metadata):
            hidden = self.model(
                torch.tensor(input_ids, dtype=torch.long, device=self.device),
                torch.tensor(positions, dtype=torch.long, device=self.device),
            )
        self._prompt_logprobs(hidden, runs)
        if not sampling:
            return None, []
        rows = torch.tensor(sampled_rows, dtype=torch.long, device=self.device)
        return self.model.compute_logits(hidden[rows]), sampling

    def _prompt_logprobs(self, hidden: torch.Tensor, runs: list[tuple[Sequence, int, int]]) -> None:
        """For the sequences asking for prompt logprobs, the logprob of each prompt token this chunk predicts
        (position p's row predicts token p + 1), only for positions not recorded before (a preemption recomputes)."""
        for seq, offset, n in runs:
            k = seq.params.prompt_logprobs
            start = len(seq.prompt_logprobs) - 1  # the first position whose prediction is not recorded yet
            end = min(seq.num_computed_tokens + n, seq.num_prompt_tokens - 1)
            if k is None or start >= end or start < seq.num_computed_tokens:
                continue
            first_row = offset + start - seq.num_computed_tokens
            # Logit rows in slices: a 512-token chunk of a 151k vocabulary is 310 MB of float32 at once.
            for begin in range(start, end, PROMPT_LOGPROB_ROWS):
                stop = min(begin + PROMPT_LOGPROB_ROWS, end)
                rows = hidden[first_row + begin - start : first_row + stop - start]
                log_probs = torch.log_softmax(self.model.compute_logits(rows).float(), dim=-1)
                targets = seq.token_ids[begin + 1 : stop + 1]
                index = torch.tensor(targets, dtype=torch.long, device=log_probs.device)[:, None]
                chosen = log_probs.gather(1, index)
                ranks = ((log_probs > chosen).sum(dim=-1) + 1).tolist()
                top = torch.topk(log_probs, k) if k else None
                for i, (token, logprob) in enumerate(zip(targets, chosen[:, 0].tolist())):
                    alternatives = list(zip(top.indices[i].tolist(), top.values[i].tolist())) if k else []
                    seq.prompt_logprobs.append(TokenLogprob(token, logprob, alternatives, ranks[i]))

    def _metadata(self, runs: list[tuple[Sequence, int, int]], table_of, window: int) -> AttentionMetadata:
        """One KV cache group's view of the step: where each new key goes and which blocks each query reads.
        With a window, a prefill chunk gathers only the blocks from its first query's window on (the others
        are placeholders in a sliding table); shifting keys and queries alike leaves the mask's geometry as is."""
        slots, decode_rows, prefills = [], [], []
        for seq, offset, n in runs:
            start = seq.num_computed_tokens
            slots.extend(self._slots(table_of(seq), start, start + n))
            if _decoding(seq, n):
                # A verifying sequence's rows are decodes of one table with growing lengths: the causal mask
                # inside the speculative window, so the step stays a decode step (one fused C++ call).
                decode_rows.extend((seq, length) for length in range(start + 1, start + n + 1))
                continue
            blocks, context = None, start + n
            if start:
                skipped = max(0, start - window + 1) // self.block_size if window else 0
                table = table_of(seq)[skipped : cdiv(start + n, self.block_size)]
                blocks = torch.tensor(table, dtype=torch.long, device=self.device)
                context -= skipped * self.block_size
            rows = None
            if self.reproducible:
                full_table = torch.tensor(table_of(seq), dtype=torch.long, device=self.device)
                rows = prompt_rows(full_table, self.block_size, offset, start, n)
            prefills.append(PrefillSegment(offset, offset + n, context, blocks, rows))
        return AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=self.device),
            decode_groups=self._decode_groups(decode_rows, table_of),
            prefills=prefills,
        )

    def _decode_groups(self, rows: list[tuple[Sequence, int]], table_of) -> list[DecodeGroup]:
        """rows: (sequence, keys its query attends to) per decode query. On the CPU all decodes go in one group:
        its kernel walks each block table in place. Elsewhere the decodes (sorted by context length) split where
        the length doubles: the gathered, padded path would otherwise copy several times the KV that attention
        needs."""
        if self.device.type == "cpu":
            return [DecodeGroup(0, len(rows), *self._decode_tables(rows, table_of))] if rows else []
        groups, start = [], 0
        for i in range(1, len(rows) + 1):
            if i == len(rows) or rows[i][1] > 2 * rows[start][1] + self.block_size:
                groups.append(DecodeGroup(start, i, *self._decode_tables(rows[start:i], table_of)))
                start = i
        return groups

    def _decode_tables(self, rows: list[tuple[Sequence, int]], table_of) -> tuple[torch.Tensor, torch.Tensor]:
        # Padded as Python lists, then one tensor each (not a tensor op per sequence): this runs every step.
        lengths = [length for _, length in rows]
        max_blocks = cdiv(max(lengths), self.block_size)
        tables = [table_of(seq)[:max_blocks] for seq, _ in rows]
        tables = [table + [0] * (max_blocks - len(table)) for table in tables]
        return (
            torch.tensor(tables, dtype=torch.long, device=self.device),
            torch.tensor(lengths, dtype=torch.long, device=self.device),
        )


def _decoding(seq: Sequence, num_new_tokens: int) -> bool:
    """A decode (the sequence's one pending token) or a verification (that token and its speculative drafts)."""
    drafts = len(seq.spec_token_ids)
    return num_new_tokens == 1 or (
        drafts > 0 and num_new_tokens == 1 + drafts and seq.num_computed_tokens + 1 == seq.num_tokens
    )
