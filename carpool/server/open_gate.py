"""The server's own gate, for when there is no key store: open to everyone, or to a fixed list of keys
(`--api-key`). The Gate contract lives in carpool.economics.contract; economics provides the gate backed by its
key store, budgets and ledger.
"""

import hashlib

from carpool.economics.contract import GateError, Principal, UsageRecord


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

    def admit(
        self,
        principal: Principal,
        tier: str,
        estimated_tokens: int,
        request_id: str | None = None,
        model: str | None = None,
    ) -> None:
        if principal.allowed_tiers is not None and tier not in principal.allowed_tiers:
            raise GateError(403, f"service_tier {tier!r} is not allowed for this key", "tier_not_allowed")

    def record(self, principal: Principal, usage: UsageRecord) -> None:
        """Without a ledger, usage is visible only through /metrics."""

    def health(self) -> None:
        return None


class RecordingGate(OpenGate):
    """An open gate that keeps every admission's request id and every usage record in memory: benchmarks that
    report cost without a ledger (the rows are priced afterwards), and tests that read what was billed."""

    def __init__(self):
        super().__init__()
        self.records: list[UsageRecord] = []
        self.admitted: list[str | None] = []

    def admit(
        self,
        principal: Principal,
        tier: str,
        estimated_tokens: int,
        request_id: str | None = None,
        model: str | None = None,
    ) -> None:
        self.admitted.append(request_id)

    def record(self, principal: Principal, usage: UsageRecord) -> None:
        self.records.append(usage)


def key_identity(api_key: str) -> str:
    """A fixed key's name wherever the server keys something by caller (prefix cache, file and batch owner): a
    hash of the whole secret, so keys sharing a prefix are strangers and the secret is never stored."""
    return "sha256:" + hashlib.sha256(api_key.encode()).hexdigest()
