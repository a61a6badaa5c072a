"""Requests and tokens per minute per key, over a sliding 60-second window of what was admitted.

A sliding window (not a counter reset on the minute) keeps a client from spending two minutes' allowance
across one minute boundary, and gives an exact Retry-After: the moment enough old admissions leave the window.
"""

import threading
from collections import deque

WINDOW_SECONDS = 60.0


class RateLimitExceeded(Exception):
    def __init__(self, message: str, retry_after: float | None):
        super().__init__(message)
        self.message, self.retry_after = message, retry_after  # None: waiting will not help


class RateLimiter:
    """The window of each key in this process's memory: one server per database (SQLite). Replicas sharing a
    PostgreSQL database keep the window there instead (carpool/economics/shared_admission.py), judged by the
    same `check_window`."""

    def __init__(self):
        self._lock = threading.Lock()
        self._windows: dict[str, deque[tuple[float, int]]] = {}  # key -> (admitted at, tokens), oldest first

    def admit(self, key_id: str, tokens: int, rpm: int | None, tpm: int | None, now: float) -> None:
        """Count the request against the key's window, or raise RateLimitExceeded without counting it."""
        if rpm is None and tpm is None:
            return
        with self._lock:
            window = self._windows.setdefault(key_id, deque())
            while window and window[0][0] <= now - WINDOW_SECONDS:
                window.popleft()
            check_window(list(window), tokens, rpm, tpm, now)
            window.append((now, tokens))


def check_window(window: list[tuple[float, int]], tokens: int, rpm: int | None, tpm: int | None, now: float) -> None:
    """Raise RateLimitExceeded unless a request of `tokens` fits beside `window`: the key's admissions of the
    last WINDOW_SECONDS as (admitted at, tokens), oldest first."""
    if tpm is not None and tokens > tpm:
        raise RateLimitExceeded(
            f"this request's {tokens} tokens exceed the key's limit of {tpm} tokens per minute", None
        )
    waits = []
    if rpm is not None and len(window) + 1 > rpm:
        # The oldest len - rpm + 1 admissions must leave; the last of them leaves at this time.
        waits.append((window[len(window) - rpm][0], f"{rpm} requests per minute"))
    used = sum(t for _, t in window)
    if tpm is not None and used + tokens > tpm:
        for admitted_at, admitted_tokens in window:
            used -= admitted_tokens
            if used + tokens <= tpm:
                waits.append((admitted_at, f"{tpm} tokens per minute"))
                break
    if waits:
        admitted_at, limit = max(waits)
        retry_after = admitted_at + WINDOW_SECONDS - now
        raise RateLimitExceeded(
            f"rate limit of {limit} reached for this key; retry in {retry_after:.1f} s", retry_after
        )
