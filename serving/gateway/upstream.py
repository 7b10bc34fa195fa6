"""Open a request on a variant's replicas, retrying before the first byte so users never see a dead replica.

The upstream client is aiohttp: its HTTP parser is C (llhttp), which matters on the per-token path of a
stream (httpx's pure-Python h11 parser and per-read timeout scopes cost ~30% of the gateway's CPU there).

Order of attempts: each healthy replica of the chosen variant (least loaded first), then, for a canary
request, the champion's. An attempt fails when the replica cannot be reached, or answers 5xx or 429
before sending anything; the failure is recorded against that replica's variant (it is the canary's
evidence) and the next attempt starts. A 4xx other than 429 is the client's and is passed through. When the
attempts run out and every replica that answered said 429, the fleet is busy, not broken: the client gets a
429 with the replicas' ``Retry-After``.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, field

import aiohttp
import orjson

from serving.gateway.metrics import GatewayMetrics, variant_label
from serving.gateway.observations import ObservationStore, RequestRecord
from serving.gateway.replicas import Replica, ReplicaPools
from serving.gateway.routing import RoutingStore

RETRYABLE = frozenset({429, 500, 502, 503, 504})


class NoReplicaAvailable(Exception):
    """Every replica of every variant in the order failed or is ejected.

    ``all_rate_limited``: at least one replica answered 429 (its queue is full) and none answered 5xx (one
    that could not be reached did not answer), so the fleet is busy rather than broken and the client gets a
    429; ``retry_after`` is the soonest ``Retry-After`` those replicas sent (None when they sent none)."""

    def __init__(self, reason: str, *, all_rate_limited: bool = False, retry_after: str | None = None) -> None:
        super().__init__(reason)
        self.all_rate_limited = all_rate_limited
        self.retry_after = retry_after


@dataclass
class Attempt:
    """An upstream response whose status is known and whose body has not been read yet."""

    variant: str
    version: str
    replica: Replica
    response: aiohttp.ClientResponse
    failed_before: list[RequestRecord] = field(default_factory=list)
    released: bool = False
    served_model: str = ""  # the name the replica was asked for (its answer says it; the client must not see it)

    @property
    def status(self) -> int:
        return self.response.status

    async def release(self, complete: bool = True) -> None:
        """Give the connection back (``complete``) or drop it, so an unfinished upstream request is
        cancelled on the replica; counts the replica's load down once, however often called."""
        if self.released:
            return
        self.released = True
        self.replica.in_flight -= 1
        if complete:
            self.response.release()
        else:
            self.response.close()


class Forwarder:
    def __init__(self, client: aiohttp.ClientSession, pools: ReplicaPools, routing: RoutingStore,
                 store: ObservationStore, metrics: GatewayMetrics, rng: random.Random | None = None,
                 fresh: aiohttp.ClientSession | None = None) -> None:
        self.client = client
        self.fresh = fresh or client  # a session that never reuses a connection, for the retry in _post
        self.pools = pools
        self.routing = routing
        self.store = store
        self.metrics = metrics
        self.rng = rng or random.Random()

    @staticmethod
    def payload(body: dict, served: str) -> bytes:
        return orjson.dumps({**body, "model": served} if served else body)

    async def open(self, request_id: str, path: str, body: dict, order: list[str], wall_start: float,
                   *, stream: bool, probe: bool, exclude: frozenset[str] = frozenset(),
                   conversation: str | None = None, lane: str = "") -> Attempt:
        """The first attempt that answers, trying ``order``'s variants in turn. An adapter lane's variants are
        adapters inside the champion's replicas: their requests go to the champion's pool, asking for the
        variant's served model."""
        failed: list[RequestRecord] = []
        retry_afters: list[str] = []
        last_reason = "no healthy replica"
        for variant in order:
            state = self.routing.state.lane_state(lane)
            routed = state.variant(variant)
            version = routed.version
            fault = state.faults.get(variant)
            payload = self.payload(body, routed.served_model)
            for replica in self.pools.pick_order("champion" if lane else variant):
                if replica.url in exclude:
                    continue
                if fault is not None and fault.delay_ms > 0:  # a drill: this variant answers slowly
                    await asyncio.sleep(fault.delay_ms / 1000)
                if fault is not None and self.rng.random() * 100 < fault.abort_percent:
                    failed.append(self._failure(request_id, variant, version, replica, 503, "injected fault",
                                                wall_start, stream, probe, conversation, lane))
                    last_reason = f"{variant}: injected fault"
                    continue
                replica.in_flight += 1
                try:
                    response = await self._post(replica.url + path, payload, request_id)
                except (aiohttp.ClientError, TimeoutError) as exc:
                    replica.in_flight -= 1
                    reason = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
                    self.pools.failed(replica, reason)
                    failed.append(self._failure(request_id, variant, version, replica, 599, reason, wall_start,
                                                stream, probe, conversation, lane))
                    last_reason = f"{variant} {replica.url}: {reason}"
                    continue
                if response.status in RETRYABLE:
                    try:
                        text = (await response.read())[:200].decode(errors="replace")
                    except (aiohttp.ClientError, TimeoutError):
                        text = ""
                    response.release()
                    replica.in_flight -= 1
                    if response.status != 429:
                        self.pools.failed(replica, f"HTTP {response.status}")
                    elif response.headers.get("retry-after"):
                        retry_afters.append(response.headers["retry-after"])
                    failed.append(self._failure(request_id, variant, version, replica, response.status, text,
                                                wall_start, stream, probe, conversation, lane))
                    last_reason = f"{variant} {replica.url}: HTTP {response.status}"
                    continue
                self.pools.succeeded(replica)
                for record in failed:
                    record.fallback_to = variant
                    self.metrics.fallbacks.labels(variant_label(lane, record.variant), variant_label(lane, variant)
                                                  ).inc()
                return Attempt(variant, version, replica, response, failed, served_model=routed.served_model)
        for record in failed:
            self.store.add(record)
            self.metrics.requests.labels(variant_label(record.lane, record.variant), record.version,
                                         str(record.status)).inc()
        busy = any(r.status == 429 for r in failed) and not any(500 <= r.status < 599 for r in failed)
        raise NoReplicaAvailable(last_reason, all_rate_limited=busy, retry_after=_soonest(retry_afters))

    async def _post(self, url: str, payload: bytes, request_id: str) -> aiohttp.ClientResponse:
        """POST upstream; a pooled connection the replica closed while idle (its keep-alive ran out first: vLLM's
        is 5 s) fails before a byte is sent back, so it is retried once on a new connection instead of being
        counted as the variant's error."""
        headers = {"content-type": "application/json", "x-request-id": request_id}
        try:
            return await self.client.post(url, data=payload, headers=headers)
        except aiohttp.ServerDisconnectedError:  # every idle connection in the pool may be as stale: a new one
            return await self.fresh.post(url, data=payload, headers=headers)

    @staticmethod
    def _failure(request_id: str, variant: str, version: str, replica: Replica, status: int, error: str,
                 wall_start: float, stream: bool, probe: bool, conversation: str | None = None,
                 lane: str = "") -> RequestRecord:
        return RequestRecord(ts=wall_start, request_id=request_id, variant=variant, version=version,
                             replica=replica.url, status=status, error=error,
                             e2e_ms=(time.time() - wall_start) * 1000, stream=stream, probe=probe,
                             conversation=conversation, lane=lane)

    def record_failures(self, attempt: Attempt) -> None:
        """Store the attempts that failed before ``attempt`` answered (the canary's errors, say)."""
        for record in attempt.failed_before:
            self.store.add(record)
            self.metrics.requests.labels(variant_label(record.lane, record.variant), record.version,
                                         str(record.status)).inc()


def _soonest(retry_afters: list[str]) -> str | None:
    """The smallest ``Retry-After`` in seconds; an HTTP-date one is passed on as sent when no other is given."""
    seconds = [int(v) for v in (v.strip() for v in retry_afters) if v.isdigit()]
    if seconds:
        return str(min(seconds))
    return retry_afters[0].strip() if retry_afters else None
