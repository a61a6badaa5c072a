"""The paged KV pool: fixed-size blocks, per-sequence block tables, reference counts and the prefix cache.

Every block is in exactly one of three states:
  - referenced: ref_count > 0, owned by one or more live sequences;
  - cached: ref_count == 0 but holding a full block of KV registered under its hash, reusable on a prefix hit;
  - empty: ref_count == 0 and no hash.
Cached and empty blocks together form the free queue, in least-recently-used order; taking a cached block
from the front evicts it from the cache.

A cached block may also be pinned (`pin_breakpoints`): a request's cache breakpoint (carpool.engine.request)
keeps the full blocks of its prefix until an expiry time, now + TTL on the injectable `clock`, renewed by every
request that hits them. A pinned block with no reference stays off the free queue, so LRU eviction never takes
it; when its TTL lapses without a hit (`expire_pins`, run at the start of every schedule) it joins the free queue
as an ordinary cached block. Pins are bounded (`max_pinned_blocks`): a breakpoint whose blocks would pass the
bound is refused whole, and its prefix stays an ordinary LRU prefix.

A model with sliding-window layers (Gemma 3's local ones) gets a second KV cache group for them, as vLLM v1's
hybrid KV cache manager does: its own pool, block ids and free queue (`SlidingWindowGroup`), and one more table
per sequence (`Sequence.sliding_block_table`). Keys that no query can see again (before the next query's
position - window + 1) give their blocks back after every step; the table keeps `null_block` there, a zeroed
block no one ever writes. A 4,000-token Gemma 3 conversation then holds 33 sliding blocks instead of 250.
"""

import hashlib
import math
import time
from array import array
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from carpool.engine.sequence import Sequence


def cdiv(a: int, b: int) -> int:
    """Ceiling division: the blocks that hold `a` tokens at `b` a block."""
    return -(-a // b)


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: bytes | None = None
    token_ids: tuple[int, ...] = ()
    partial_keys: tuple = ()  # its keys in BlockManager.partial (cached blocks of the full-attention group)
    pinned_until: float = 0.0  # a TTL pin's expiry on the block manager's clock; 0: not pinned
    pin_ttl: float = 0.0  # that pin's TTL, which every hit renews


@dataclass
class PinStats:
    """The pins' counters since start, for metrics (written on the engine thread only)."""

    pinned_blocks: Counter = field(default_factory=Counter)  # TTL seconds -> blocks pinned now
    expired_blocks: Counter = field(default_factory=Counter)  # TTL seconds -> blocks whose pin lapsed without a hit
    expiries: int = 0  # pinned prefixes (runs of blocks expiring together) that lapsed
    refused: int = 0  # breakpoints refused because their blocks would pass max_pinned_blocks
    hits: int = 0  # admissions that read at least one pinned block
    hit_tokens: int = 0  # prompt tokens read from pinned blocks

    def copy(self) -> "PinStats":
        """A snapshot for another thread (Counter copies are single C calls: safe against the engine thread)."""
        return PinStats(
            Counter(self.pinned_blocks),
            Counter(self.expired_blocks),
            self.expiries,
            self.refused,
            self.hits,
            self.hit_tokens,
        )

    @staticmethod
    def summed(stats: list["PinStats"]) -> "PinStats":
        """Several engines' (replicas') stats as one."""
        total = PinStats()
        for one in stats:
            total.pinned_blocks.update(one.pinned_blocks)
            total.expired_blocks.update(one.expired_blocks)
            total.expiries += one.expiries
            total.refused += one.refused
            total.hits += one.hits
            total.hit_tokens += one.hit_tokens
        return total


@dataclass(frozen=True)
class PartialHit:
    """The first `num_tokens` tokens of a sequence's next block, found in the cached block `block_id`: their KV is
    copied into a block of the sequence's own instead of computed."""

    block_id: int
    num_tokens: int


def hash_block(parent: bytes | None, token_ids: list[int], salt: str | None) -> bytes:
    """A full block's key covers its parent's key (so the whole prefix), its tokens and the tenant's salt."""
    digest = hashlib.sha256(parent or b"")
    digest.update(array("q", token_ids).tobytes())
    digest.update((salt or "").encode())
    return digest.digest()


def prompt_hash_chain(token_ids: list[int], block_size: int, salt: str | None) -> list[bytes]:
    """The keys of a prompt's full blocks in the prefix cache, in order (what the ledger keeps of a prompt)."""
    chain, parent = [], None
    for start in range(0, len(token_ids) - len(token_ids) % block_size, block_size):
        parent = hash_block(parent, token_ids[start : start + block_size], salt)
        chain.append(parent)
    return chain


class BlockManager:
    """The full-attention group (every layer of a model without sliding windows), and through `sliding` the
    sliding-window group when there is one. The public methods answer for both groups."""

    indexes_partial_hits = True

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        sliding_window: int = 0,
        num_sliding_blocks: int | None = None,
        max_pinned_blocks: int = 0,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[bytes, int] = {}  # block hash -> block id
        # (parent's hash, tenant's salt, n, hash of the first n tokens) -> a cached block that starts so: where
        # partial_hit looks for a block's first tokens. Only this group's (a sliding group's hit must be whole).
        self.partial: dict[tuple, int] = {}
        self.max_pinned_blocks = max_pinned_blocks if enable_prefix_caching else 0
        self.clock = clock
        self.pinned: dict[int, None] = {}  # every pinned block, referenced or not, in the order pinned
        self.pin_stats = PinStats()
        self._next_expiry = math.inf  # no pin lapses before this (a lower bound: hits only push expiries later)
        # The sliding group's pool holds every sequence's window, not whole contexts (carpool.engine.kv_pools);
        # admission and allocation check both groups, so it running short makes requests wait.
        self.sliding = (
            SlidingWindowGroup(
                num_blocks if num_sliding_blocks is None else num_sliding_blocks,
                block_size,
                enable_prefix_caching,
                sliding_window,
            )
            if sliding_window
            else None
        )

    def table(self, seq: Sequence) -> list[int]:
        return seq.block_table

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def num_cached_blocks(self) -> int:
        return len(self.cached)

    def usage(self) -> float:
        """Share of blocks held by live sequences or pins (cached-but-unreferenced blocks count as free)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        return max(0, cdiv(num_tokens, self.block_size) - len(self.table(seq)))

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

        The last token is never served from the cache: the engine needs its logits to sample from. Nor is a
        position whose prompt logprob is still to be read (prompt_logprobs: its logits are needed too).
        """
        if not self.enable_prefix_caching:
            return []
        hits = []
        for i, block_hash in enumerate(self._block_hashes(seq, self._servable(seq) // self.block_size)):
            block_id = self._cached_block(seq, i, block_hash)
            if block_id is None:
                break
            hits.append(block_id)
        if self.sliding:
            del hits[self.sliding.longest_covered_prefix(seq, len(hits)) :]
        return hits

    @staticmethod
    def _servable(seq: Sequence) -> int:
        """How many of seq's first tokens the cache may serve: never the last, whose logits the engine samples
        from, nor a position whose prompt logprob is still to be read (prompt_logprobs: its logits are needed)."""
        servable = seq.num_tokens - 1
        if seq.params.prompt_logprobs is not None:
            servable = min(servable, len(seq.prompt_logprobs) - 1)
        return servable

    def partial_hit(self, seq: Sequence, hits: list[int]) -> PartialHit | None:
        """The longest start of seq's block after `hits` that a cached block also starts with. Blocks are cached
        and hashed whole, so without this a shared prefix that ends inside a block (a system prompt's last tokens,
        a conversation's previous turn) was computed again by every request: token-granular reuse, as llama.cpp's
        slots and SGLang's radix cache have. None without a hit, and for a model with sliding-window layers."""
        if not self.enable_prefix_caching or self.sliding:
            return None
        start = len(hits) * self.block_size
        wanted = seq.token_ids[start : start + min(self._servable(seq) - start, self.block_size)]
        parent = self._block_hashes(seq, len(hits))[-1] if hits else None
        for n in range(len(wanted), 0, -1):
            block_id = self.partial.get((parent, seq.cache_salt, n, hash(tuple(wanted[:n]))))
            if block_id is not None and self.blocks[block_id].token_ids[:n] == tuple(wanted[:n]):
                return PartialHit(block_id, n)
        return None

    def _cached_block(self, seq: Sequence, index: int, block_hash: bytes) -> int | None:
        """The cached block holding seq's index-th block, if any. The stored tokens are compared too, so that a
        hash collision can never serve another prompt's KV."""
        block_id = self.cached.get(block_hash)
        bs = self.block_size
        if block_id is None or self.blocks[block_id].token_ids != tuple(seq.token_ids[index * bs : (index + 1) * bs]):
            return None
        return block_id

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
        if self.sliding and not self.sliding._fits(self.sliding.window_hits(seq, len(hits)), len(hits), num_new_tokens):
            return False
        return self._fits(hits, len(hits), num_new_tokens)

    def _fits(self, hits: list[int], num_hit_blocks: int, num_new_tokens: int) -> bool:
        """Whether the table can take `hits` (its blocks from num_hit_blocks - len(hits) on; placeholders
        before them) and then blocks for num_new_tokens more tokens."""
        revived = sum(1 for b in hits if b in self.free_queue)  # an idle pinned block is not taken from the queue
        total = num_hit_blocks * self.block_size + num_new_tokens
        return cdiv(total, self.block_size) - num_hit_blocks + revived <= self.num_free_blocks

    def admit(self, seq: Sequence, hits: list[int], partial: PartialHit | None = None) -> None:
        """Share the matched cached blocks with seq (by reference, never copied). With a partial hit, seq gets a
        block of its own for the next position, and its first partial.num_tokens tokens count as computed: the
        caller copies their KV from partial.block_id into seq.block_table[len(hits)] before the next forward."""
        self._take(seq, hits)
        if self.sliding:
            self.sliding.admit_window(seq, len(hits))
        seq.num_computed_tokens = len(hits) * self.block_size
        if partial:
            self.allocate(seq, seq.num_computed_tokens + partial.num_tokens)
            seq.num_computed_tokens += partial.num_tokens

    def _take(self, seq: Sequence, hits: list[int]) -> None:
        now, pinned_hits = self.clock(), 0
        for block_id in hits:
            block = self.blocks[block_id]
            if block.ref_count == 0 and not block.pinned_until:
                del self.free_queue[block_id]
            if block.pinned_until:  # a hit renews the pin
                block.pinned_until = max(block.pinned_until, now + block.pin_ttl)
                pinned_hits += 1
            block.ref_count += 1
            self.table(seq).append(block_id)
        if pinned_hits:
            self.pin_stats.hits += 1
            self.pin_stats.hit_tokens += pinned_hits * self.block_size

    def cache_full_blocks(self, seq: Sequence) -> None:
        """After a step: register the blocks that seq's computed tokens have filled, so later requests can hit
        them, and give back the sliding-window blocks that its next queries can no longer see."""
        for i in self._register_full_blocks(seq):
            seq.written_blocks.add(i)
            seq.num_cache_write_tokens += self._written_tokens(seq, i)
        self.pin_breakpoints(seq)
        if self.sliding:
            self.sliding._register_full_blocks(seq)
            self.sliding.release_out_of_window(seq)

    def _register_full_blocks(self, seq: Sequence) -> list[int]:
        """Hash the table's full blocks that are not in the cache yet; returns the indices registered."""
        if not self.enable_prefix_caching:
            return []
        bs = self.block_size
        registered = []
        table = self.table(seq)
        for i, block_hash in enumerate(self._block_hashes(seq, seq.num_computed_tokens // bs)):
            if table[i] >= self.num_blocks:
                continue  # the sliding group's placeholder for keys out of the window
            block = self.blocks[table[i]]
            if block.block_hash is not None:
                continue
            if block_hash in self.cached:
                continue  # another block already holds this prefix; this one stays private
            block.block_hash = block_hash
            block.token_ids = tuple(seq.token_ids[i * bs : (i + 1) * bs])
            self.cached[block_hash] = block.block_id
            if self.indexes_partial_hits:
                parent = seq.block_hashes[i - 1] if i else None
                block.partial_keys = tuple((parent, seq.cache_salt, n, hash(block.token_ids[:n])) for n in range(1, bs))
                for key in block.partial_keys:
                    self.partial.setdefault(key, block.block_id)
            registered.append(i)
        return registered

    # Pins --------------------------------------------------------------------------------------------

    def pin_breakpoints(self, seq: Sequence) -> None:
        """Pin the full blocks of each of seq's breakpoints whose prefix seq has now computed (its hits and the
        blocks it wrote), for the first breakpoint's TTL that covers them (TTLs never grow along a request).

        A segment's blocks are pinned all together or not at all: the bound is checked once for the whole segment,
        while seq holds every block of it (none can be evicted meanwhile). Refused, it and every later segment
        stay ordinary LRU cache (a later segment is of no use without the prefix before it). The prompt tokens
        seq wrote into a pinned segment move from its automatic writes to its TTL writes, which are billed by TTL.
        """
        breakpoints = seq.cache_breakpoints
        computed_blocks = seq.num_computed_tokens // self.block_size
        while seq.num_pinned_breakpoints < len(breakpoints):
            point = breakpoints[seq.num_pinned_breakpoints]
            end = point.num_tokens // self.block_size
            if end > computed_blocks:
                return
            start = seq.pinned_through_block
            seq.num_pinned_breakpoints += 1
            block_ids = [self.cached.get(h) for h in self._block_hashes(seq, end)[start:end]]
            if None in block_ids:  # a block of the prefix is not cached (prefix caching off): nothing to keep
                seq.num_pinned_breakpoints = len(breakpoints)
                return
            if len(self.pinned) + sum(1 for b in block_ids if not self.blocks[b].pinned_until) > self.max_pinned_blocks:
                self.pin_stats.refused += 1
                seq.num_pinned_breakpoints = len(breakpoints)
                return
            self._pin(block_ids, point.ttl_seconds)
            seq.pinned_through_block = end
            written = sum(self._written_tokens(seq, i) for i in range(start, end) if i in seq.written_blocks)
            if written:
                seq.num_cache_write_tokens -= written
                seq.cache_write_tokens_by_ttl[point.ttl_seconds] += written

    def _written_tokens(self, seq: Sequence, index: int) -> int:
        """The prompt tokens of seq's block `index` that seq computed (cache_full_blocks bills them as writes)."""
        bs = self.block_size
        return max(0, min((index + 1) * bs, seq.num_prompt_tokens) - max(index * bs, seq.num_cached_prompt_tokens))

    def _pin(self, block_ids: list[int], ttl: float) -> None:
        until = self.clock() + ttl
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.pinned_until >= until:
                continue  # already pinned for longer
            if block.pinned_until:
                self.pin_stats.pinned_blocks[block.pin_ttl] -= 1
            else:
                self.pinned[block_id] = None
                if block.ref_count == 0:
                    del self.free_queue[block_id]
            block.pinned_until, block.pin_ttl = until, ttl
            self.pin_stats.pinned_blocks[ttl] += 1
        self._next_expiry = min(self._next_expiry, until)

    def expire_pins(self) -> None:
        """Unpin the blocks whose TTL has lapsed without a hit: they become ordinary cached blocks, at the
        free queue's most recently used end (their prefix's tail first, so it is evicted before its head)."""
        now = self.clock()
        if now < self._next_expiry:
            return
        lapsed = [b for b in self.pinned if self.blocks[b].pinned_until <= now]
        # The blocks of a prefix were pinned, and renewed, together: they share an expiry time.
        self.pin_stats.expiries += len({self.blocks[b].pinned_until for b in lapsed})
        for block_id in reversed(lapsed):
            block = self.blocks[block_id]
            del self.pinned[block_id]
            self.pin_stats.pinned_blocks[block.pin_ttl] -= 1
            self.pin_stats.expired_blocks[block.pin_ttl] += 1
            block.pinned_until = block.pin_ttl = 0.0
            if block.ref_count == 0:
                self.free_queue[block_id] = None
        self._next_expiry = min((self.blocks[b].pinned_until for b in self.pinned), default=math.inf)

    # Allocation --------------------------------------------------------------------------------------

    def can_allocate(self, seq: Sequence, num_tokens: int) -> bool:
        if self.sliding and not self.sliding.can_allocate(seq, num_tokens):
            return False
        return self.blocks_needed(seq, num_tokens) <= self.num_free_blocks

    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        """Grow seq's block tables to hold num_tokens tokens. Check can_allocate first."""
        if self.sliding:
            self.sliding.allocate(seq, num_tokens)
        for _ in range(self.blocks_needed(seq, num_tokens)):
            block_id, _ = self.free_queue.popitem(last=False)
            block = self.blocks[block_id]
            if block.block_hash is not None:
                del self.cached[block.block_hash]
                for key in block.partial_keys:
                    if self.partial.get(key) == block_id:
                        del self.partial[key]
                block.block_hash, block.token_ids, block.partial_keys = None, (), ()
            block.ref_count = 1
            self.table(seq).append(block_id)

    def free(self, seq: Sequence) -> None:
        """Release seq's blocks. Cached ones stay reusable; the sequence's tail is evicted before its head."""
        if self.sliding:
            self.sliding.free(seq)
        table = self.table(seq)
        for block_id in reversed(table):
            self._release(block_id)
        table.clear()
        seq.num_computed_tokens = 0

    def truncate(self, seq: Sequence, num_tokens: int) -> None:
        """Give back seq's blocks past the first num_tokens tokens (rejected speculative tokens' slots). Those
        blocks were never registered in the prefix cache: only computed, accepted tokens' blocks are."""
        keep = cdiv(num_tokens, self.block_size)
        del seq.block_hashes[num_tokens // self.block_size :]
        for group in filter(None, (self, self.sliding)):
            table = group.table(seq)
            while len(table) > keep:
                block_id = table.pop()
                if block_id != getattr(group, "null_block", None):
                    group._release(block_id)

    def _release(self, block_id: int) -> None:
        block = self.blocks[block_id]
        block.ref_count -= 1
        if block.ref_count == 0 and not block.pinned_until:  # a pinned block waits for its TTL off the queue
            self.free_queue[block_id] = None
            if block.block_hash is None:
                self.free_queue.move_to_end(block_id, last=False)  # empty blocks are reused first


class SlidingWindowGroup(BlockManager):
    """The sliding-window layers' blocks. A sequence's table runs parallel to its full-attention table (same
    token positions), but the blocks wholly before the window of its next query are given back and replaced by
    `null_block`: decode reads only in-window keys and prefill gathers only in-window blocks, so the
    placeholder is never read (and it is a real zeroed block of the pool, so a stray read could not bring NaN).

    Prefix cache (vLLM's rule): a hit of L tokens needs the full group's blocks for [0, L) and this group's
    blocks for the window before L, [L - window + 1, L), still cached."""

    indexes_partial_hits = False

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool, window: int):
        super().__init__(num_blocks, block_size, enable_prefix_caching)
        self.window = window
        self.null_block = num_blocks  # the pool's extra, last block (ModelRunner allocates num_blocks + 1)

    def table(self, seq: Sequence) -> list[int]:
        return seq.sliding_block_table

    def first_needed_block(self, position: int) -> int:
        """The first block a query at `position` (and every later one) still reads."""
        return max(0, position - self.window + 1) // self.block_size

    def longest_covered_prefix(self, seq: Sequence, num_blocks: int) -> int:
        """The largest k <= num_blocks whose in-window blocks, [first_needed_block(k * block_size), k), are all
        cached here. Each block is looked up at most once."""
        hashes = self._block_hashes(seq, num_blocks)
        end, i = num_blocks, num_blocks - 1
        while end > 0:
            first = self.first_needed_block(end * self.block_size)
            while i >= first and self._cached_block(seq, i, hashes[i]) is not None:
                i -= 1
            if i < first:
                return end
            end, i = i, i - 1  # block i is missing: a hit must end before it
        return 0

    def window_hits(self, seq: Sequence, num_hit_blocks: int) -> list[int]:
        """The cached blocks a hit of num_hit_blocks full blocks takes here (match_prefix checked they exist)."""
        hashes = self._block_hashes(seq, num_hit_blocks)
        first = self.first_needed_block(num_hit_blocks * self.block_size)
        return [self._cached_block(seq, i, hashes[i]) for i in range(first, num_hit_blocks)]

    def admit_window(self, seq: Sequence, num_hit_blocks: int) -> None:
        hits = self.window_hits(seq, num_hit_blocks)
        seq.sliding_block_table.extend([self.null_block] * (num_hit_blocks - len(hits)))
        self._take(seq, hits)

    def free(self, seq: Sequence) -> None:
        table = seq.sliding_block_table
        for block_id in reversed(table):
            if block_id != self.null_block:
                self._release(block_id)
        table.clear()

    def release_out_of_window(self, seq: Sequence) -> None:
        """Give back the blocks before the window of seq's next query (at position num_computed_tokens)."""
        table = seq.sliding_block_table
        i = self.first_needed_block(seq.num_computed_tokens) - 1
        while i >= 0 and table[i] != self.null_block:
            self._release(table[i])
            table[i] = self.null_block
            i -= 1
