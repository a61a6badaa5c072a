"""Who may call, what they may ask for, and where their usage goes: the server asks a Gate at these points.

`authenticate` runs before anything else (401 on failure), `admit` before a request enters the engine
(401, 403, 429 or 503 on failure: a batch line is admitted long after its batch's caller authenticated, so
admission judges the key as it stands then), `record` once per finished or aborted request, and `health` says
whether the gate can do its job (/health reports it). The open gate accepts everyone, or checks a fixed list
of keys; economics provides a gate backed by its key store, budgets and ledger.
"""

import hashlib
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Protocol

from carpool.economics.usage import UsageRecord


@dataclass
class Principal:
    """The caller as the gate knows it."""

    key_id: str | None = None
    tenant: str | None = None
    allowed_tiers: frozenset[str] | None = None  # None: every tier
    is_admin: bool = False


class GateError(Exception):
    def __init__(self, status: int, message: str, code: str, retry_after: float | None = None):
        super().__init__(message)
        self.status, self.message, self.code, self.retry_after = status, message, code, retry_after


class Gate(Protocol):
    def authenticate(self, api_key: str | None) -> Principal: ...

    def admit(self, principal: Principal, tier: str, estimated_tokens: int) -> None: ...

    def record(self, principal: Principal, usage: UsageRecord) -> Future | None:
        """Account for a finished request. A Future resolves once the usage is durable, and the caller hears
        of its request only then; it fails with the GateError to answer instead. None: nothing to wait for."""

    def health(self) -> str | None:
        """None while the gate works; else what is wrong, for /health."""


class OpenGate:
    """No key store: open to everyone, or to holders of one of a fixed set of keys (`--api-key`), none of them
    an admin: each key sees only its own files and batches, and caches only its own prefixes."""

    def __init__(self, api_keys: list[str] | None = None):
        self.api_keys = set(api_keys or [])

    def authenticate(self, api_key: str | None) -> Principal:
        if not self.api_keys:
            return Principal()
        if api_key not in self.api_keys:
            raise GateError(401, "Incorrect or missing API key.", "invalid_api_key")
        return Principal(key_id=key_identity(api_key))

    def admit(self, principal: Principal, tier: str, estimated_tokens: int) -> None:
        if principal.allowed_tiers is not None and tier not in principal.allowed_tiers:
            raise GateError(403, f"service_tier {tier!r} is not allowed for this key", "tier_not_allowed")

    def record(self, principal: Principal, usage: UsageRecord) -> None:
        """Without a ledger, usage is visible only through /metrics."""

    def health(self) -> None:
        return None


def key_identity(api_key: str) -> str:
    """A fixed key's name wherever the server keys something by caller (prefix cache, file and batch owner): a
    hash of the whole secret, so keys sharing a prefix are strangers and the secret is never stored."""
    return "sha256:" + hashlib.sha256(api_key.encode()).hexdigest()
