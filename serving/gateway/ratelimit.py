"""Per-key token buckets on requests and on tokens, answering *when* to retry.

A request reserves its estimated cost up front (one request; prompt estimate + ``max_tokens``, see
``token_cost``, which refuses before this a cost no bucket could ever hold), so a burst cannot overrun the
budget while answers are still streaming; when the answer's real usage is known the difference is refunded,
all of it when nothing was generated. ``Retry-After`` is the time until the bucket holds the cost again.
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass, field


@dataclass
class TokenBucket:
    """``capacity`` units, refilled continuously at ``capacity`` per minute."""

    capacity: float
    level: float = -1.0
    updated: float = field(default_factory=time.monotonic)

    def __post_init__(self) -> None:
        if self.level < 0:
            self.level = self.capacity

    @property
    def rate_per_s(self) -> float:
        return self.capacity / 60.0

    def _refill(self, now: float) -> None:
        self.level = min(self.capacity, self.level + (now - self.updated) * self.rate_per_s)
        self.updated = now

    def wait_for(self, cost: float, now: float) -> float:
        """Seconds until ``cost`` units are available (0 if now); a cost above capacity waits for a full bucket."""
        self._refill(now)
        need = min(cost, self.capacity) - self.level
        return 0.0 if need <= 0 else need / self.rate_per_s

    def take(self, cost: float) -> None:
        self.level -= cost

    def give_back(self, amount: float) -> None:
        self.level = min(self.capacity, self.level + amount)


@dataclass
class Reservation:
    key: str
    tokens: float


class RateLimited(Exception):
    def __init__(self, what: str, retry_after_s: float) -> None:
        super().__init__(what)
        self.what = what
        self.retry_after_s = retry_after_s

    @property
    def retry_after_header(self) -> str:
        return str(max(1, math.ceil(self.retry_after_s)))


class RateLimiter:
    """One request bucket and one token bucket per key name."""

    def __init__(self) -> None:
        self._buckets: dict[str, tuple[TokenBucket, TokenBucket]] = {}
        self._lock = threading.Lock()

    def reserve(self, key: str, requests_per_minute: float, tokens_per_minute: float, tokens: float,
                now: float | None = None) -> Reservation:
        """Take one request and ``tokens`` tokens from ``key``'s buckets, or raise RateLimited."""
        now = time.monotonic() if now is None else now
        with self._lock:
            pair = self._buckets.get(key)
            if pair is None or pair[0].capacity != requests_per_minute or pair[1].capacity != tokens_per_minute:
                pair = (TokenBucket(requests_per_minute), TokenBucket(tokens_per_minute))
                self._buckets[key] = pair
            requests, budget = pair
            wait_requests = requests.wait_for(1.0, now)
            if wait_requests > 0:
                raise RateLimited(f"request rate limit of {requests_per_minute:g}/min reached", wait_requests)
            wait_tokens = budget.wait_for(tokens, now)
            if wait_tokens > 0:
                raise RateLimited(f"token rate limit of {tokens_per_minute:g}/min reached "
                                  f"(this request reserves {tokens:.0f})", wait_tokens)
            requests.take(1.0)
            budget.take(tokens)
        return Reservation(key, tokens)

    def settle(self, reservation: Reservation, used_tokens: float | None) -> None:
        """Refund what the request reserved but did not use (nothing if usage is unknown)."""
        if used_tokens is None:
            return
        with self._lock:
            pair = self._buckets.get(reservation.key)
            if pair is not None:
                pair[1].give_back(max(0.0, reservation.tokens - used_tokens))
