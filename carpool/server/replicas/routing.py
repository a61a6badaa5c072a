"""Which replica a request goes to: prefix-cache affinity, least loaded, or round-robin.

Prefix affinity remembers, for the hash chain of the first blocks of every prompt it routed (salted as the
replicas' prefix caches salt them, so two tenants' equal prompts are different prefixes), which replicas it sent
them to, and sends a request to the replica that holds the longest run of its leading blocks: SGLang's
cache-aware router and Ray Serve LLM's PrefixCacheAffinityRouter do the same with a radix tree of text. A prompt
whose best match covers less than half of it (a new conversation under a shared system prompt) goes to the
least loaded replica instead, which spreads new work while each conversation stays where its cache is.
"""

import itertools
from collections import Counter, OrderedDict
from dataclasses import dataclass

from carpool.engine.request import EngineRequest

ROUTINGS = ("prefix", "least-loaded", "round-robin")
PRIORITY_TIER = "priority"


@dataclass
class ReplicaLoad:
    """What the router knows of a replica: its own count of requests it sent there and has not seen finish
    (exact, no polling lag), and the replica's last reported KV usage and slots."""

    in_flight: int = 0
    slots: int = 1
    kv_usage: float = 0.0
    healthy: bool = True

    @property
    def has_room(self) -> bool:
        return self.healthy and self.in_flight < self.slots and self.kv_usage < FULL_KV


FULL_KV = 0.95  # a replica this full preempts: new work elsewhere costs a prefill, not a recompute


def least_loaded(loads: list[ReplicaLoad], cached: list[int] | None = None) -> int:
    """The healthy replica with the fewest requests in flight (then the emptiest KV pool, then the fewest
    `cached` blocks); any replica when none is healthy (the request then fails there, cleanly, rather than
    waiting for one)."""
    candidates = [i for i, load in enumerate(loads) if load.healthy] or list(range(len(loads)))
    return min(candidates, key=lambda i: (loads[i].in_flight, loads[i].kv_usage, cached[i] if cached else 0, i))


class Routing:
    def choose(self, request: EngineRequest, loads: list[ReplicaLoad]) -> int:
        raise NotImplementedError

    def forget(self, replica: int) -> None:
        """A replica restarted with an empty cache (only prefix affinity remembers anything)."""


class RoundRobin(Routing):
    def __init__(self):
        self._turn = itertools.count()

    def choose(self, request: EngineRequest, loads: list[ReplicaLoad]) -> int:
        for _ in range(len(loads)):
            index = next(self._turn) % len(loads)
            if loads[index].healthy:
                return index
        return least_loaded(loads)


class LeastLoaded(Routing):
    def choose(self, request: EngineRequest, loads: list[ReplicaLoad]) -> int:
        return least_loaded(loads)


class PrefixAffinity(Routing):
    """`block_size`: the replicas' KV block (a prefix is cached in whole blocks). `max_blocks`: how many leading
    blocks are hashed (a longer match says little more about where the cache is). `imbalance`: how many more
    requests in flight than the least loaded replica the prefix's replica may have before work spills over.
    `max_entries`: the hashes remembered (least recently routed forgotten first; the replicas evict too)."""

    MIN_MATCH = 0.5

    def __init__(self, block_size: int, max_blocks: int = 64, imbalance: int = 8, max_entries: int = 200_000):
        if block_size < 1:
            raise ValueError("block_size must be at least 1")
        self.block_size, self.max_blocks, self.imbalance = block_size, max_blocks, imbalance
        self.max_entries = max_entries
        self._holders: OrderedDict[int, set[int]] = OrderedDict()  # block-chain hash -> replicas sent it
        # Blocks each replica is remembered to hold: among equally loaded replicas a new prefix goes to the one
        # caching least, so an idle pair does not pile every new document on the first (as SGLang's router does).
        self._held: Counter[int] = Counter()

    def block_hashes(self, request: EngineRequest) -> list[int]:
        tokens, size = request.prompt_token_ids, self.block_size
        chain, hashes = hash(("salt", request.cache_salt)), []
        for start in range(0, min(len(tokens) // size, self.max_blocks) * size, size):
            chain = hash((chain, tuple(tokens[start : start + size])))
            hashes.append(chain)
        return hashes

    def matched_blocks(self, hashes: list[int], replica: int) -> int:
        for count, block in enumerate(hashes):
            if replica not in self._holders.get(block, ()):
                return count
        return len(hashes)

    def choose(self, request: EngineRequest, loads: list[ReplicaLoad]) -> int:
        return self.choose_hashed(self.block_hashes(request), len(request.prompt_token_ids), request.tier, loads)

    def choose_hashed(self, hashes: list, prompt_tokens: int, tier: str, loads: list[ReplicaLoad]) -> int:
        """`choose` for a prompt known by its leading block hashes (a replayed ledger row's chain) and length."""
        chosen = self._choose(hashes[: self.max_blocks], prompt_tokens, tier, loads)
        self._remember(hashes[: self.max_blocks], chosen)
        return chosen

    def _choose(self, hashes: list, prompt_tokens: int, tier: str, loads: list[ReplicaLoad]) -> int:
        fallback = least_loaded(loads, [self._held[i] for i in range(len(loads))])
        healthy = [i for i, load in enumerate(loads) if load.healthy]
        if not hashes or not healthy:
            return fallback
        matches = {i: self.matched_blocks(hashes, i) for i in healthy}
        best = max(healthy, key=lambda i: (matches[i], -loads[i].in_flight, -i))
        if matches[best] * self.block_size < self.MIN_MATCH * prompt_tokens:
            return fallback
        load = loads[best]
        if tier == PRIORITY_TIER:  # latency first: the cached replica only if it can start at once
            return best if load.has_room else fallback
        # Other tiers may queue behind their cache (a hit saves the prefill), within `imbalance`.
        overloaded = load.kv_usage >= FULL_KV or load.in_flight - loads[fallback].in_flight > self.imbalance
        return fallback if overloaded else best

    def _remember(self, hashes: list[int], replica: int) -> None:
        for block in hashes:
            holders = self._holders.get(block)
            if holders is None:
                holders = self._holders[block] = set()
            if replica not in holders:
                holders.add(replica)
                self._held[replica] += 1
            self._holders.move_to_end(block)
        while len(self._holders) > self.max_entries:
            for holder in self._holders.popitem(last=False)[1]:
                self._held[holder] -= 1

    def forget(self, replica: int) -> None:
        """A replica that died and restarts comes back with an empty cache."""
        for holders in self._holders.values():
            holders.discard(replica)
        self._held[replica] = 0


def make_routing(name: str, block_size: int):
    if name == "prefix":
        return PrefixAffinity(block_size)
    if name == "least-loaded":
        return LeastLoaded()
    if name == "round-robin":
        return RoundRobin()
    raise ValueError(f"routing must be one of {', '.join(ROUTINGS)}, got {name!r}")
