"""Mirror a share of champion traffic to the shadow variant, compare the answers, never return them.

A mirror is a separate non-streaming request sent at the same time as the user's; the user's answer never
waits for it. Its budget (mirrors in flight, estimated tokens in flight) is checked before sending, and a
mirror over budget is dropped and counted, so shadowing can cost the champion at most that budget even
when both variants share a host. When both answers are in, the pair is compared (``compare.py``) and
stored for the rollout controller.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import aiohttp
import orjson

from serving.gateway.compare import compare_replies
from serving.gateway.config import ShadowConfig
from serving.gateway.metrics import GatewayMetrics, variant_label
from serving.gateway.observations import ObservationStore, PairRecord, RequestRecord
from serving.gateway.replicas import ReplicaPools
from serving.gateway.routing import RoutingStore
from serving.gateway.sse import response_text

log = logging.getLogger("serving.gateway")
PRIMARY_WAIT_S = 600.0


class Mirror:
    """One mirrored request; the proxy reports the primary's outcome with ``primary_done``."""

    def __init__(self) -> None:
        self._primary: asyncio.Future = asyncio.get_running_loop().create_future()

    def primary_done(self, text: str, status: int, ms: float, completion_tokens: int | None = None) -> None:
        if not self._primary.done():
            self._primary.set_result((text, status, ms, completion_tokens))


class ShadowMirror:
    def __init__(self, client: aiohttp.ClientSession, pools: ReplicaPools, routing: RoutingStore,
                 store: ObservationStore, metrics: GatewayMetrics, config: ShadowConfig,
                 tokenize: Callable[[str], list] | None = None) -> None:
        self.client = client
        self.pools = pools
        self.routing = routing
        self.store = store
        self.metrics = metrics
        self.config = config
        self.tokenize = tokenize
        self.in_flight = 0
        self.tokens_in_flight = 0
        self._tasks: set[asyncio.Task] = set()

    def try_start(self, request_id: str, path: str, body: dict, estimated_tokens: int, prompt: str,
                  lane: str = "") -> Mirror | None:
        """Mirror one request to the shadow variant of its lane (an adapter lane's shadow is an adapter inside the
        champion's replicas), unless the mirroring budget is spent."""
        if self.in_flight >= self.config.max_concurrency:
            self.metrics.shadow_dropped.labels("concurrency").inc()
            return None
        if self.tokens_in_flight + estimated_tokens > self.config.max_tokens_in_flight:
            self.metrics.shadow_dropped.labels("tokens").inc()
            return None
        replicas = self.pools.pick_order("champion" if lane else "shadow")
        if not replicas:
            self.metrics.shadow_dropped.labels("no_replica").inc()
            return None
        mirror = Mirror()
        self.in_flight += 1
        self.tokens_in_flight += estimated_tokens
        task = asyncio.create_task(self._run(mirror, request_id, path, body, estimated_tokens, prompt,
                                             replicas[0].url, lane))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return mirror

    async def _run(self, mirror: Mirror, request_id: str, path: str, body: dict, estimated_tokens: int,
                   prompt: str, url: str, lane: str) -> None:
        state = self.routing.state.lane_state(lane)
        shadow = state.shadow
        payload = {**body, "stream": False}
        payload.pop("stream_options", None)
        if shadow.served_model:
            payload["model"] = shadow.served_model
        wall = time.time()
        start = time.perf_counter()
        status, text, error, usage = 599, "", None, {}
        try:
            async with self.client.post(url + path, data=orjson.dumps(payload),
                                        headers={"content-type": "application/json",
                                                 "x-request-id": f"{request_id}-shadow"}) as response:
                status = response.status
                body = await response.read()
            if status == 200:
                answer = orjson.loads(body)
                text, usage = response_text(answer), answer.get("usage") or {}
            else:
                error = body[:200].decode(errors="replace")
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            error = f"{type(exc).__name__}: {exc}"
        finally:
            self.in_flight -= 1
            self.tokens_in_flight -= estimated_tokens
        shadow_ms = (time.perf_counter() - start) * 1000
        self.store.add(RequestRecord(ts=wall, request_id=f"{request_id}-shadow", variant="shadow",
                                     version=shadow.version, replica=url, status=status, error=error,
                                     e2e_ms=shadow_ms, prompt_tokens=usage.get("prompt_tokens"),
                                     completion_tokens=usage.get("completion_tokens"), lane=lane))
        self.metrics.requests.labels(variant_label(lane, "shadow"), shadow.version, str(status)).inc()
        try:
            primary = await asyncio.wait_for(mirror._primary, PRIMARY_WAIT_S)
            primary_text, primary_status, primary_ms, primary_tokens = primary
        except TimeoutError:
            return
        if status != 200 or primary_status != 200:
            self.metrics.shadow_pairs.labels("shadow_error" if status != 200 else "primary_error").inc()
        cmp = compare_replies(primary_text, text, self.tokenize)
        if status == 200 and primary_status == 200:
            self.metrics.shadow_pairs.labels("agree" if cmp.agree else "disagree").inc()
            if cmp.exact_match:
                self.metrics.shadow_exact.inc()
        cap = self.config.store_text_chars
        self.store.add(PairRecord(
            ts=wall, request_id=request_id, path=path, prompt=prompt[:cap], primary_version=state.champion.version,
            shadow_version=shadow.version, primary_status=primary_status, shadow_status=status,
            primary_ms=primary_ms, shadow_ms=shadow_ms, primary_text=primary_text[:cap], shadow_text=text[:cap],
            exact_match=cmp.exact_match, same_answer=cmp.same_answer, answer_primary=cmp.answer_primary,
            answer_shadow=cmp.answer_shadow, refusal_primary=cmp.refusal_primary,
            refusal_shadow=cmp.refusal_shadow, first_divergence=cmp.first_divergence,
            length_ratio=cmp.length_ratio, similarity=cmp.similarity, agree=cmp.agree,
            primary_tokens=primary_tokens, shadow_tokens=usage.get("completion_tokens"), lane=lane))

    async def drain(self, timeout: float = 5.0) -> None:
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=timeout)
