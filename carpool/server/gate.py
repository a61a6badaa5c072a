"""Who may call, what they may ask for, and where their usage goes: the server asks a Gate at three points.

`authenticate` runs before anything else (401 on failure), `admit` before a request enters the engine
(429 on failure), `record` once per finished or aborted request. The open gate accepts everyone, or checks
a fixed list of keys; economics provides a gate backed by its key store, budgets and ledger.
"""

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

    def record(self, principal: Principal, usage: UsageRecord) -> None: ...


class OpenGate:
    """No key store: open to everyone, or to holders of one of a fixed set of keys (`--api-key`)."""

    def __init__(self, api_keys: list[str] | None = None):
        self.api_keys = set(api_keys or [])

    def authenticate(self, api_key: str | None) -> Principal:
        if not self.api_keys:
            return Principal()
        if api_key not in self.api_keys:
            raise GateError(401, "Incorrect or missing API key.", "invalid_api_key")
        return Principal(key_id=api_key[:8], tenant=None, is_admin=True)

    def admit(self, principal: Principal, tier: str, estimated_tokens: int) -> None:
        if principal.allowed_tiers is not None and tier not in principal.allowed_tiers:
            raise GateError(403, f"service_tier {tier!r} is not allowed for this key", "tier_not_allowed")

    def record(self, principal: Principal, usage: UsageRecord) -> None:
        """Without a ledger, usage is visible only through /metrics."""
