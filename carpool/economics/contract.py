"""The contract between the server and whoever judges and bills its callers: the only economics module the server
imports (besides the concrete gate its command line builds), and it imports nothing from carpool.

The server asks a Gate at these points: `authenticate` before anything else (401 on failure), `admit` before a
request enters the engine (401, 403, 429 or 503 on failure: a batch line is admitted long after its batch's
caller authenticated, so admission judges the key as it stands then), `record` once per finished or aborted
request, with the request's UsageRecord, and `health` to say whether the gate can do its job (/health reports
it). A refusal is a GateError: plain data (HTTP status, OpenAI error code, message, when to retry) that the
server turns into OpenAI's error body.
"""

import base64
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Protocol

# The finish_reason of a row billed nothing: its result never reached the client (the ledger could not write it
# in time, its request id was billed already, or a batch line stopped that another run will answer).
WITHHELD = "withheld"

# What a key may do beyond its own tenant's requests, files and batches: each scope is granted explicitly.
USAGE_READ = "usage:read"  # the usage reports (/v1/usage) and the dashboard's ledger panels: every tenant's spend
BATCHES_READ_ALL = "batches:read-all"  # list and read every tenant's batch objects (status, counts, file ids)
FILES_READ_ALL = "files:read-all"  # read every tenant's files, batch inputs and outputs: their prompts (audited)
SCOPES = (USAGE_READ, BATCHES_READ_ALL, FILES_READ_ALL)


@dataclass
class Principal:
    """The caller as the gate knows it."""

    key_id: str | None = None
    tenant: str | None = None
    allowed_tiers: frozenset[str] | None = None  # None: every tier
    scopes: frozenset[str] = frozenset()  # of SCOPES

    def may(self, scope: str) -> bool:
        return scope in self.scopes


class GateError(Exception):
    """A refusal: `status` is the HTTP status to answer, `code` OpenAI's error code (`invalid_api_key`,
    `tier_not_allowed`, `insufficient_quota`, `rate_limit_exceeded`, `ledger_unavailable`, ...), `param` the
    request parameter at fault, if one is."""

    def __init__(
        self, status: int, message: str, code: str, retry_after: float | None = None, param: str | None = None
    ):
        super().__init__(message)
        self.status, self.message, self.code, self.retry_after, self.param = status, message, code, retry_after, param


@dataclass
class UsageRecord:
    """What the server hands to the gate after every request: one plain record, no engine internals.

    `request_id` names the row, unique among billed rows (carpool/economics/ledger.py). A request the client sent
    is one row (its n choices or prompts summed) named by the `x-request-id` the client saw. A request that runs
    as several rows (its prompt's compression, a cascade's attempts) names each part `part_request_id(client's
    id, part)`, with the client's id in `parent_request_id`. A batch line is a request of its own, named by the
    `request_id` its output line shows."""

    request_id: str
    model: str
    tier: str  # a service tier's name (carpool.engine.tiers)
    prompt_tokens: int  # all prompt tokens, cached ones included
    cached_tokens: int  # prompt tokens read from the prefix cache
    cache_write_tokens: int  # prompt tokens that created new prefix-cache entries (automatic, LRU: no TTL)
    output_tokens: int
    queue_seconds: float
    prefill_seconds: float
    decode_seconds: float
    finish_reason: str  # "stop" | "length" | "abort" | "error" | WITHHELD
    key_id: str | None = None
    tenant: str | None = None
    created: float = field(default_factory=time.time)
    # How the row relates to what the client sent (the ledger's columns of the same names say more).
    purpose: str = "request"  # "request" | "cascade_attempt" | "compression"
    parent_request_id: str | None = None
    cascade: str | None = None
    cascade_step: int | None = None
    cascade_accepted: bool | None = None
    constraint_kind: str | None = None
    original_prompt_tokens: int | None = None
    # Prompt tokens written under a cache breakpoint's TTL pin (Anthropic's cache_control), by TTL: not in
    # cache_write_tokens. A TTL up to 5 minutes counts as 5m, a longer one as 1h.
    cache_write_5m_tokens: int = 0
    cache_write_1h_tokens: int = 0
    # What a replay needs (`carpool cost whatif`): when it arrived (unix seconds), and its prompts' prefix-cache
    # block hashes (`block_chain_text`), which show shared prefixes as shared and carry no text.
    arrived: float | None = None
    prompt_block_chain: str | None = None

    @property
    def uncached_prompt_tokens(self) -> int:
        return self.prompt_tokens - self.cached_tokens


def part_request_id(parent: str, part: str) -> str:
    """The request id of one part (`compression`, `cascade-0`, ...) of the client's request `parent`."""
    return f"{parent}#{part}"


# A prompt block's hash as the ledger keeps it: the first 8 bytes of the prefix cache's sha256 key (a collision
# among a day's distinct blocks is a ~1e-8 chance at 1e6 of them), 12 characters of base64 each.
CHAIN_DIGEST_BYTES = 8


def block_chain_text(chains: list[list[bytes]]) -> str | None:
    """A request's prompts' block-hash chains (the prefix cache's keys: each covers every block before it and
    the request's cache salt) as one ledger value: one base64 run per prompt, comma-separated. Equal leading
    hashes are a shared prefix, whoever's text it was; only the tenant's own salt makes them equal."""
    if not any(chains):
        return None
    return ",".join(
        base64.b64encode(b"".join(digest[:CHAIN_DIGEST_BYTES] for digest in chain)).decode() for chain in chains
    )


def read_block_chain(text: str | None) -> list[list[bytes]]:
    """block_chain_text's value back as chains of CHAIN_DIGEST_BYTES-byte hashes ([] for NULL)."""
    if not text:
        return []
    chains = []
    for run in text.split(","):
        raw = base64.b64decode(run)
        chains.append([raw[i : i + CHAIN_DIGEST_BYTES] for i in range(0, len(raw), CHAIN_DIGEST_BYTES)])
    return chains


FIVE_MINUTES = 300.0


def ttl_write_tokens(tokens_by_ttl: dict[float, int]) -> tuple[int, int]:
    """(5m, 1h) write tokens from the engine's {TTL seconds: tokens}: a pin of up to 5 minutes is a 5m write,
    a longer one a 1h write (the dearer class, so a pin is never billed for less than it holds)."""
    five = sum(tokens for ttl, tokens in tokens_by_ttl.items() if ttl <= FIVE_MINUTES)
    return five, sum(tokens_by_ttl.values()) - five


class Gate(Protocol):
    def authenticate(self, api_key: str | None) -> Principal: ...

    def admit(
        self,
        principal: Principal,
        tier: str,
        estimated_tokens: int,
        request_id: str | None = None,
        model: str | None = None,
    ) -> None:
        """`request_id`: the request whose `record` will follow, for a gate that reserves budget until then
        (None: nothing will be recorded, as for a batch's creation); `model`: the served model it runs on."""

    def record(self, principal: Principal, usage: UsageRecord) -> Future | None:
        """Account for a finished request. A Future resolves once the usage is durable, and the caller hears
        of its request only then; it fails with the GateError to answer instead. None: nothing to wait for."""

    def health(self) -> str | None:
        """None while the gate works; else what is wrong, for /health."""

    def audit(self, principal: Principal, action: str, target: str, owner: str | None) -> None:
        """Record, durably and before the caller sees it, that `principal` used a read-all scope to `action`
        (`files.content`, ...) `target`, an object of `owner` (another tenant)."""
