"""Replica pools per variant: active health checks on /ready, passive ejection on failed requests.

A replica is ejected after ``eject_after`` consecutive failures, counted from both the poller (a /ready
that is not 200) and real requests (refused connection, 5xx before the first byte), and taken back as
soon as /ready answers 200 again. Requests go to the healthy replica with the fewest requests in flight.
Once ready, a replica's /v1/models is read for the context length it serves (``max_model_len``, as our
server and vLLM say it), so the gateway can refuse a request no replica could ever fit; an ejected replica
is asked again when it is back, since it may serve another model then.
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
    max_model_len: int | None = None  # its context length, from /v1/models (None: not said, or not yet)
    models_read: bool = False  # /v1/models answered (a server that does not say max_model_len is not asked again)


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

    def largest_context(self) -> int | None:
        """The longest context among the healthy replicas that answer users (the shadow's answers reach
        nobody): what does not fit it fits none. None while one of them has not said its own."""
        lengths = [r.max_model_len for r in self.all() if r.healthy and r.variant != "shadow"]
        return None if not lengths or None in lengths else max(lengths)

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
            replica.max_model_len, replica.models_read = None, False
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
            if not replica.models_read:
                await self._read_context(client, replica, timeout_s)
        else:
            self.failed(replica, f"/ready answered {status}")

    async def _read_context(self, client: aiohttp.ClientSession, replica: Replica, timeout_s: float) -> None:
        try:
            async with client.get(f"{replica.url}/v1/models", timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
                payload = await r.json(content_type=None) if r.status == 200 else None
        except (aiohttp.ClientError, TimeoutError, ValueError):
            return  # asked again at the next poll
        replica.models_read = True
        models = payload.get("data") if isinstance(payload, dict) else None
        first = models[0] if isinstance(models, list) and models and isinstance(models[0], dict) else {}
        length = first.get("max_model_len")
        said = isinstance(length, int) and not isinstance(length, bool) and length > 0
        replica.max_model_len = length if said else None
