"""Replica pools per variant: active health checks on /ready, passive ejection on failed requests.

A replica is ejected after ``eject_after`` consecutive failures, counted from both the poller (a /ready
that is not 200) and real requests (refused connection, 5xx before the first byte), and taken back as
soon as /ready answers 200 again. Requests go to the healthy replica with the fewest requests in flight.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from dataclasses import dataclass

import aiohttp

from serving.gateway.metrics import GatewayMetrics

log = logging.getLogger("serving.gateway")


@dataclass
class Replica:
    url: str
    variant: str
    healthy: bool = True  # optimistic until the first poll says otherwise
    failures: int = 0
    in_flight: int = 0
    last_error: str = ""
    last_checked: float = 0.0


class ReplicaPools:
    def __init__(self, metrics: GatewayMetrics, eject_after: int) -> None:
        self.metrics = metrics
        self.eject_after = eject_after
        self._replicas: dict[tuple[str, str], Replica] = {}
        self._rr = itertools.count()

    def sync(self, variants: dict[str, list[str]]) -> None:
        """Make the pools match the routing state (new replicas start healthy; removed ones are dropped)."""
        wanted = {(name, url) for name, urls in variants.items() for url in urls}
        for key in list(self._replicas):
            if key not in wanted:
                del self._replicas[key]
                try:
                    self.metrics.replica_up.remove(*key)
                except KeyError:
                    pass
        for name, url in wanted:
            if (name, url) not in self._replicas:
                self._replicas[(name, url)] = Replica(url, name)
                self.metrics.replica_up.labels(name, url).set(1)

    def replicas(self, variant: str) -> list[Replica]:
        return [r for (v, _), r in self._replicas.items() if v == variant]

    def healthy(self, variant: str) -> list[Replica]:
        return [r for r in self.replicas(variant) if r.healthy]

    def pick_order(self, variant: str) -> list[Replica]:
        """Healthy replicas, least loaded first (ties round-robin); ejected ones are not tried."""
        pool = self.healthy(variant)
        if not pool:
            return []
        start = next(self._rr) % len(pool)
        rotated = pool[start:] + pool[:start]
        return sorted(rotated, key=lambda r: r.in_flight)

    def all(self) -> list[Replica]:
        return list(self._replicas.values())

    # ----------------------------------------------------------------- outcomes
    def succeeded(self, replica: Replica) -> None:
        replica.failures = 0
        if not replica.healthy:
            log.info("replica %s (%s) is back", replica.url, replica.variant)
        replica.healthy = True
        self.metrics.replica_up.labels(replica.variant, replica.url).set(1)

    def failed(self, replica: Replica, reason: str) -> None:
        replica.failures += 1
        replica.last_error = reason
        if replica.healthy and replica.failures >= self.eject_after:
            replica.healthy = False
            log.warning("replica %s (%s) ejected after %d failures: %s", replica.url, replica.variant,
                        replica.failures, reason)
            self.metrics.replica_up.labels(replica.variant, replica.url).set(0)

    # ----------------------------------------------------------------- active checks
    async def poll_forever(self, client: aiohttp.ClientSession, interval_s: float, timeout_s: float) -> None:
        while True:
            await asyncio.gather(*(self._check(client, r, timeout_s) for r in self.all()))
            await asyncio.sleep(interval_s)

    async def _check(self, client: aiohttp.ClientSession, replica: Replica, timeout_s: float) -> None:
        replica.last_checked = time.time()
        try:
            async with client.get(f"{replica.url}/ready", timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
                status = r.status
                await r.read()
        except (aiohttp.ClientError, TimeoutError) as exc:
            self.failed(replica, f"/ready: {type(exc).__name__}")
            return
        if status == 200:
            self.succeeded(replica)
        else:
            self.failed(replica, f"/ready answered {status}")
