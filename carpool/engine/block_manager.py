"""The paged KV pool: fixed-size blocks, per-sequence block tables, reference counts and the prefix cache.

Every block is in exactly one of three states:
  - referenced: ref_count > 0, owned by one or more live sequences;
  - cached: ref_count == 0 but holding a full block of KV registered under its hash, reusable on a prefix hit;
  - empty: ref_count == 0 and no hash.
Cached and empty blocks together form the free queue, in least-recently-used order; taking a cached block
from the front evicts it from the cache.
"""

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass

from carpool.engine.sequence import Sequence


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: bytes | None = None
    token_ids: tuple[int, ...] = ()


def hash_block(parent: bytes | None, token_ids: list[int], salt: str | None) -> bytes:
    """A full block's key covers its parent's key (so the whole prefix), its tokens and the tenant's salt."""
    digest = hashlib.sha256(parent or b"")
    digest.update(array("q", token_ids).tobytes())
    digest.update((salt or "").encode())
    return digest.digest()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[bytes, int] = {}  # block hash -> block id

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def num_cached_blocks(self) -> int:
        return len(self.cached)

    def usage(self) -> float:
        """Share of blocks held by live sequences (cached-but-unreferenced blocks count as free)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        return max(0, -(-num_tokens // self.block_size) - len(seq.block_table))

    # Prefix cache ------------------------------------------------------------------------------------

    def _block_hashes(self, seq: Sequence, num_full_blocks: int) -> list[bytes]:
        bs = self.block_size
        while len(seq.block_hashes) < num_full_blocks:
            i = len(seq.block_hashes)
            parent = seq.block_hashes[-1] if i else None
            seq.block_hashes.append(hash_block(parent, seq.token_ids[i * bs : (i + 1) * bs], seq.cache_salt))
        return seq.block_hashes[:num_full_blocks]

    def match_prefix(self, seq: Sequence) -> list[int]:
        """Cached blocks holding the longest prefix of seq's tokens (read-only: nothing is claimed yet).

        The last token is never served from the cache: the engine needs its logits to sample from.
        """
        if not self.enable_prefix_caching:
            return []
        bs = self.block_size
        hits = []
        for i, block_hash in enumerate(self._block_hashes(seq, (seq.num_tokens - 1) // bs)):
            block_id = self.cached.get(block_hash)
            # Compare the stored tokens too, so that a hash collision can never serve another prompt's KV.
            if block_id is None or self.blocks[block_id].token_ids != tuple(seq.token_ids[i * bs : (i + 1) * bs]):
                break
            hits.append(block_id)
        return hits

    def prompt_block_hash(self, seq: Sequence, index: int) -> bytes | None:
        """Hash of seq's index-th block if it is a full block of the prompt, else None."""
        if not self.enable_prefix_caching or (index + 1) * self.block_size > seq.num_prompt_tokens:
            return None
        return self._block_hashes(seq, index + 1)[index]

    def uncomputed_prompt_hashes(self, seq: Sequence) -> list[bytes]:
        """Hashes of seq's full prompt blocks that are not computed yet (they will be cached as it prefills)."""
        if not self.enable_prefix_caching:
            return []
        first = seq.num_computed_tokens // self.block_size
        return self._block_hashes(seq, seq.num_prompt_tokens // self.block_size)[first:]

    def can_admit(self, seq: Sequence, hits: list[int], num_new_tokens: int) -> bool:
        """Whether seq can take `hits` and get blocks for `num_new_tokens` more tokens after them."""
        revived = sum(1 for b in hits if self.blocks[b].ref_count == 0)
        total = len(hits) * self.block_size + num_new_tokens
        return -(-total // self.block_size) - len(hits) + revived <= self.num_free_blocks

    def admit(self, seq: Sequence, hits: list[int]) -> None:
        """Share the matched cached blocks with seq (by reference, never copied)."""
        for block_id in hits:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free_queue[block_id]
            block.ref_count += 1
            seq.block_table.append(block_id)
        seq.num_computed_tokens = len(hits) * self.block_size

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register the blocks that seq's computed tokens have filled, so later requests can hit them."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        num_full = seq.num_computed_tokens // bs
        for i, block_hash in enumerate(self._block_hashes(seq, num_full)):
            block = self.blocks[seq.block_table[i]]
            if block.block_hash is not None:
                continue
            if block_hash in self.cached:
                continue  # another block already holds this prefix; this one stays private
            block.block_hash = block_hash
            block.token_ids = tuple(seq.token_ids[i * bs : (i + 1) * bs])
            self.cached[block_hash] = block.block_id
            seq.num_cache_write_tokens += max(0, min(bs, seq.num_prompt_tokens - i * bs))

    # Allocation --------------------------------------------------------------------------------------

    def can_allocate(self, seq: Sequence, num_tokens: int) -> bool:
        return self.blocks_needed(seq, num_tokens) <= self.num_free_blocks

    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        """Grow seq's block table to hold num_tokens tokens. Check can_allocate first."""
        for _ in range(self.blocks_needed(seq, num_tokens)):
            block_id, _ = self.free_queue.popitem(last=False)
            block = self.blocks[block_id]
            if block.block_hash is not None:
                del self.cached[block.block_hash]
                block.block_hash, block.token_ids = None, ()
            block.ref_count = 1
            seq.block_table.append(block_id)

    def free(self, seq: Sequence) -> None:
        """Release seq's blocks. Cached ones stay reusable; the sequence's tail is evicted before its head."""
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_queue[block_id] = None
                if block.block_hash is None:
                    self.free_queue.move_to_end(block_id, last=False)  # empty blocks are reused first
        seq.block_table = []
        seq.num_computed_tokens = 0
