"""One client request through the gateway: identify, authenticate, limit, route, forward, observe.

The data path reads top to bottom in ``handle`` (who is asking, and whether the body is sane: ``admission.py``).
Everything a rollout judges (status, TTFT, inter-token gaps, end-to-end latency, tokens, and the shadow pair)
is recorded as the answer leaves, off the user's critical path (the observation store writes from its own
thread).
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import aiohttp
import anyio
import orjson
from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from serving.client_disconnect import wait_for_disconnect
from serving.gateway.admission import authenticate, check_fields, conversation_key, request_id_of, short_hash
from serving.gateway.config import GatewayConfig
from serving.gateway.continuation import Continuation, continuation
from serving.gateway.errors import GatewayError
from serving.gateway.keys import ApiKey, KeyStore
from serving.gateway.metrics import GatewayMetrics, variant_label
from serving.gateway.observations import ObservationStore, RequestRecord
from serving.gateway.ratelimit import RateLimited, RateLimiter, Reservation
from serving.gateway.routing import VARIANT_NAMES, RoutingStore, choose_variant
from serving.gateway.shadow import Mirror, ShadowMirror
from serving.gateway.sse import (
    EventSplitter,
    StreamReading,
    read_event,
    response_text,
    strip_token_ids,
    with_public_model,
)
from serving.gateway.token_cost import TokenCost, refuse_what_never_fits, token_cost
from serving.gateway.upstream import Attempt, Forwarder, NoReplicaAvailable

log = logging.getLogger("serving.gateway")
access_log = logging.getLogger("serving.gateway.access")  # one line per request; the gateway CLI rotates it

PIN_HEADER = "x-lifecycle-variant"  # admin only: send this request to one variant, no fallback
PROBE_HEADER = "x-lifecycle-probe"  # admin only: a controller probe, kept out of the traffic statistics


@dataclass
class RequestContext:
    request_id: str
    key: ApiKey
    path: str
    body: dict
    stream: bool
    wants_usage: bool
    wall_start: float
    perf_start: float
    cost: TokenCost
    reservation: Reservation | None
    probe: bool
    pinned: bool = False
    mirror: Mirror | None = None
    conversation: str | None = None  # short hash of the sticky key, for counting users per variant
    wants_token_ids: bool = False  # the client asked for return_token_ids itself (else they are stripped)
    public_model: str = ""  # the name answers carry, whichever replica wrote them
    lane: str = ""  # the adapter lane the request's model names; "" for the base model


def _prompt_text(body: dict) -> str:
    if isinstance(body.get("prompt"), str):
        return body["prompt"]
    parts = []
    for message in body.get("messages") or []:
        if isinstance(message, dict) and isinstance(message.get("content"), str):
            parts.append(f"{message.get('role', '')}: {message['content']}")
    return "\n".join(parts)


@dataclass(eq=False)
class Proxy:
    config: GatewayConfig
    keys: KeyStore | None
    routing: RoutingStore
    forwarder: Forwarder
    shadow: ShadowMirror
    store: ObservationStore
    metrics: GatewayMetrics
    limiter: RateLimiter
    rng: random.Random = field(default_factory=random.Random)

    # ----------------------------------------------------------------- the data path
    async def handle(self, request: Request, path: str) -> Response:
        wall_start, perf_start = time.time(), time.perf_counter()
        request_id = request_id_of(request)
        try:
            key = authenticate(request, self.keys)
            body = await self._json_body(request)
            ctx = self._admit(request, key, path, body, request_id, wall_start, perf_start)
        except GatewayError as exc:
            self.metrics.rejected.labels(_reject_reason(exc)).inc()
            access_log.info("%s %s -> %d %s", request_id, path, exc.status, exc.message)
            return exc.response(request_id)
        conversation = conversation_key(request, key, body)
        ctx.conversation = None if conversation is None else short_hash(conversation)
        order, pinned = self._route(request, conversation, ctx.lane)
        ctx.pinned = pinned
        if order[0] == "champion" and not pinned and not ctx.probe:
            self._maybe_mirror(ctx)
        in_flight = self.metrics.in_flight.labels(variant_label(ctx.lane, order[0]))
        in_flight.inc()
        try:
            attempt = await self.forwarder.open(request_id, path, body, order, wall_start, stream=ctx.stream,
                                                probe=ctx.probe, conversation=ctx.conversation, lane=ctx.lane)
        except NoReplicaAvailable as exc:
            in_flight.dec()
            self._settle(ctx, None, generated=False)
            error = _no_replica_error(exc)
            if ctx.mirror is not None:
                ctx.mirror.primary_done("", error.status, 0.0)
            access_log.info("%s %s key=%s -> %d %s", request_id, path, key.name, error.status, exc)
            if error.status != 429:  # a busy fleet is load, not a fault
                log.warning("%s %s -> 503 no replica (%s)", request_id, path, exc)
            return error.response(request_id)
        in_flight.dec()
        self.forwarder.record_failures(attempt)
        headers = {"x-request-id": request_id, "x-lifecycle-variant": attempt.variant,
                   "x-lifecycle-version": attempt.version}
        if ctx.stream and attempt.status == 200:
            return StreamingResponse(self._stream(ctx, attempt), media_type="text/event-stream", headers=headers)
        return await self._full(request, ctx, attempt, headers)

    async def _json_body(self, request: Request) -> dict:
        raw = await request.body()
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            raise GatewayError(400, f"malformed JSON body: {exc}") from None
        if not isinstance(body, dict):
            raise GatewayError(400, "request body must be a JSON object")
        return body

    def _admit(self, request: Request, key: ApiKey, path: str, body: dict, request_id: str, wall_start: float,
               perf_start: float) -> RequestContext:
        model = body.get("model")
        found = self.routing.state.lane(model) if model is None or isinstance(model, str) else None
        if found is None:
            raise GatewayError(404, f"The model `{model}` does not exist.", "invalid_request_error",
                               "model_not_found", "model")
        lane, _ = found
        public = lane or self.routing.state.public_model
        check_fields(body, path)
        stream = body.get("stream") is True
        wants_usage = bool((body.get("stream_options") or {}).get("include_usage")) if isinstance(
            body.get("stream_options"), dict) else False
        wants_token_ids = body.get("return_token_ids") is True
        if stream:  # ask upstream for usage so tokens are counted; dropped again if the client did not ask
            body["stream_options"] = {**(body.get("stream_options") or {}), "include_usage": True}
            if self.config.stream_token_ids:  # to continue a broken stream from its tokens (continuation.py)
                body["return_token_ids"] = True
        probe = False
        if request.headers.get(PROBE_HEADER) or request.headers.get(PIN_HEADER):
            if not key.admin:
                raise GatewayError(403, f"{PIN_HEADER} and {PROBE_HEADER} need an admin key", "permission_error",
                                   "not_admin")
            probe = bool(request.headers.get(PROBE_HEADER))
        limits = self.config.limits
        cost = token_cost(body, path, limits.default_max_tokens)
        token_budget = None if self.keys is None else (key.tokens_per_minute or limits.tokens_per_minute)
        refuse_what_never_fits(cost, path, self.forwarder.pools.largest_context(), token_budget)
        reservation = None
        if token_budget is not None:
            try:
                reservation = self.limiter.reserve(key.name, key.requests_per_minute or limits.requests_per_minute,
                                                   token_budget, cost.total)
            except RateLimited as exc:
                raise GatewayError(429, f"{exc.what}; retry in {exc.retry_after_header} s", "rate_limit_error",
                                   "rate_limit_exceeded", headers={"retry-after": exc.retry_after_header}) from None
        return RequestContext(request_id, key, path, body, stream, wants_usage, wall_start, perf_start, cost,
                              reservation, probe, wants_token_ids=wants_token_ids, public_model=public, lane=lane)

    def _route(self, request: Request, conversation: str | None, lane: str) -> tuple[list[str], bool]:
        pinned = request.headers.get(PIN_HEADER)
        if pinned:
            if pinned not in VARIANT_NAMES:
                pinned = "champion"
            return [pinned], True
        variant = choose_variant(self.routing.state.lane_state(lane), conversation, self.rng)
        return ([variant] if variant == "champion" else [variant, "champion"]), False

    def _maybe_mirror(self, ctx: RequestContext) -> None:
        state = self.routing.state.lane_state(ctx.lane)
        if not state.active("shadow") or state.shadow_fraction <= 0 or self.rng.random() >= state.shadow_fraction:
            return
        body = ctx.body
        if body.get("temperature") != 0 and body.get("seed") is None:
            # the same seed on both sides: a sampled request then differs only where the models do
            body["seed"] = self.rng.randrange(2 ** 31)
        ctx.mirror = self.shadow.try_start(ctx.request_id, ctx.path, body, ctx.cost.total, _prompt_text(body),
                                           ctx.lane)

    # ----------------------------------------------------------------- answers
    async def _full(self, request: Request, ctx: RequestContext, attempt: Attempt, headers: dict) -> Response:
        read = asyncio.ensure_future(attempt.response.read())
        gone = asyncio.ensure_future(wait_for_disconnect(request))
        complete = False
        try:
            done, _ = await asyncio.wait({read, gone}, return_when=asyncio.FIRST_COMPLETED)
            if read not in done:  # the client left: stop the upstream work too
                read.cancel()
                self._finish(ctx, attempt, 499, "client disconnected", None, [], None, None)
                return Response(status_code=499)
            content = read.result()
            complete = True
        except (aiohttp.ClientError, TimeoutError) as exc:
            self._finish(ctx, attempt, 599, f"{type(exc).__name__}: {exc}", None, [], None, None)
            return GatewayError(502, f"the replica broke off the answer ({type(exc).__name__})", "server_error",
                                ).response(ctx.request_id)
        finally:
            gone.cancel()
            with anyio.CancelScope(shield=True):
                await attempt.release(complete)
        status = attempt.status
        text, usage = "", None
        if status == 200:
            try:
                payload = orjson.loads(content)
                text, usage = response_text(payload), payload.get("usage")
            except orjson.JSONDecodeError:
                pass
        self._finish(ctx, attempt, status, None if status < 400 else content[:200].decode(errors="replace"), None,
                     [], text, usage)
        if status == 200:
            content = with_public_model(content, attempt.served_model, ctx.public_model)
        media = attempt.response.headers.get("content-type", "application/json")
        return Response(content, status_code=status, media_type=media, headers=headers)

    async def _stream(self, ctx: RequestContext, attempt: Attempt) -> AsyncIterator[bytes]:
        reading = StreamReading()
        first_token: float | None = None
        gaps: list[float] = []
        last = None
        status, error = 200, None
        continued = complete = False
        resumed: Continuation | None = None  # how to read the events of a replica that took over
        fault = self.routing.state.lane_state(ctx.lane).faults.get(attempt.variant)
        # a drill, a slower decode: each token after the first leaves at least token_gap after the one before
        token_gap = fault.token_gap_ms / 1000 if fault is not None else 0.0
        try:
            while True:
                splitter, broke = EventSplitter(), None
                try:
                    async for chunk in attempt.response.content.iter_any():
                        out = []
                        for payload in splitter.feed(chunk):
                            if resumed is not None:
                                payload = resumed.translate(payload)
                            new_text, usage_only = read_event(payload, reading)
                            if reading.error is not None:
                                break
                            if continued and not new_text and b'"role"' in payload:
                                continue  # the continuation's opening role chunk: the client has had one
                            if new_text:
                                if token_gap and first_token is not None:
                                    await asyncio.sleep(max(0.0, last + token_gap - time.perf_counter()))
                                now = time.perf_counter()
                                if first_token is None:
                                    first_token = now
                                else:
                                    gaps.append(now - last)
                                last = now
                            if usage_only and not ctx.wants_usage:
                                continue
                            if not ctx.wants_token_ids:
                                payload = strip_token_ids(payload)
                            payload = with_public_model(payload, attempt.served_model, ctx.public_model)
                            out.append(b"data: " + payload + b"\n\n")
                        if out:
                            yield b"".join(out)
                        if reading.error is not None:
                            broke = f"error event: {reading.error.get('message', '')}"[:200]
                            break
                except (aiohttp.ClientError, TimeoutError) as exc:
                    broke = f"{type(exc).__name__}: {exc}"
                if broke is None:
                    complete = True
                    break
                # the replica died mid-answer: finish it on another replica (the champion's if need be)
                resumed = self._continuation(ctx, reading)
                nxt = None if resumed is None else await self._continue_elsewhere(ctx, attempt, resumed)
                if nxt is None:
                    status, error = 599, broke
                    yield b"data: " + orjson.dumps(GatewayError(502, "the replica broke off the stream",
                                                                "server_error").body()) + b"\n\n"
                    return
                self._record_broken(ctx, attempt, broke, nxt)
                with anyio.CancelScope(shield=True):
                    await attempt.release(complete=False)
                attempt, continued = nxt, True
                reading.error = None
        except (asyncio.CancelledError, GeneratorExit):
            status, error = 499, "client disconnected"
            raise
        finally:
            with anyio.CancelScope(shield=True):
                await attempt.release(complete)
                ttft = (first_token - ctx.perf_start) if first_token is not None else None
                text = reading.text if ctx.mirror is not None else None
                self._finish(ctx, attempt, status, error, ttft, gaps, text, reading.usage)

    def _continuation(self, ctx: RequestContext, reading: StreamReading) -> Continuation | None:
        return None if ctx.pinned else continuation(ctx.path, ctx.body, reading)

    async def _continue_elsewhere(self, ctx: RequestContext, broken: Attempt, resumed: Continuation
                                  ) -> Attempt | None:
        """Re-open the request on another replica, asking it to continue the partial answer from its token ids
        (or, from a replica that sends none, from its text: see continuation.py)."""
        self.forwarder.pools.failed(broken.replica, "broke off a stream")
        order = [broken.variant] if broken.variant == "champion" else [broken.variant, "champion"]
        try:
            attempt = await self.forwarder.open(ctx.request_id, resumed.path, resumed.body, order, ctx.wall_start,
                                                stream=True,
                                                probe=ctx.probe, exclude=frozenset({broken.replica.url}),
                                                conversation=ctx.conversation, lane=ctx.lane)
        except NoReplicaAvailable:
            return None
        if attempt.status != 200:
            await attempt.release(complete=False)
            return None
        self.forwarder.record_failures(attempt)
        return attempt

    def _record_broken(self, ctx: RequestContext, attempt: Attempt, reason: str, nxt: Attempt) -> None:
        """The broken attempt counts against its variant; the user's answer goes on from ``nxt``."""
        self.store.add(RequestRecord(ts=ctx.wall_start, request_id=ctx.request_id, variant=attempt.variant,
                                     version=attempt.version, replica=attempt.replica.url, status=599, error=reason,
                                     e2e_ms=(time.perf_counter() - ctx.perf_start) * 1000, stream=True,
                                     probe=ctx.probe, fallback_to=nxt.variant, conversation=ctx.conversation,
                                     lane=ctx.lane))
        self.metrics.requests.labels(variant_label(ctx.lane, attempt.variant), attempt.version, "599").inc()
        self.metrics.fallbacks.labels(variant_label(ctx.lane, attempt.variant), variant_label(ctx.lane, nxt.variant)
                                      ).inc()
        log.warning("%s stream broke on %s (%s): continued on %s %s", ctx.request_id, attempt.replica.url,
                    attempt.variant, nxt.variant, nxt.replica.url)

    def _finish(self, ctx: RequestContext, attempt: Attempt, status: int, error: str | None, ttft_s: float | None,
                gaps: list[float], text: str | None, usage: dict | None) -> None:
        e2e = time.perf_counter() - ctx.perf_start
        variant, label = attempt.variant, variant_label(ctx.lane, attempt.variant)
        m = self.metrics
        m.requests.labels(label, attempt.version, str(status)).inc()
        m.e2e.labels(label).observe(e2e)
        if ttft_s is not None:
            m.ttft.labels(label).observe(ttft_s)
        itl_hist = m.itl.labels(label)
        for gap in gaps:
            itl_hist.observe(gap)
        prompt_tokens = completion_tokens = None
        if isinstance(usage, dict):
            prompt_tokens, completion_tokens = usage.get("prompt_tokens"), usage.get("completion_tokens")
            if isinstance(prompt_tokens, int):
                m.tokens.labels(label, "prompt").inc(prompt_tokens)
            if isinstance(completion_tokens, int):
                m.tokens.labels(label, "completion").inc(completion_tokens)
        self.store.add(RequestRecord(
            ts=ctx.wall_start, request_id=ctx.request_id, variant=variant, version=attempt.version,
            replica=attempt.replica.url, status=status, error=error,
            ttft_ms=ttft_s * 1000 if ttft_s is not None else None,
            itl_ms=(sum(gaps) / len(gaps) * 1000) if gaps else None, e2e_ms=e2e * 1000,
            prompt_tokens=prompt_tokens, completion_tokens=completion_tokens, stream=ctx.stream, probe=ctx.probe,
            conversation=ctx.conversation, lane=ctx.lane))
        self._settle(ctx, usage, generated=not 400 <= status < 500)  # a replica's 4xx generated nothing
        if ctx.mirror is not None:
            ctx.mirror.primary_done(text or "", status, e2e * 1000,
                                    completion_tokens if isinstance(completion_tokens, int) else None)
        access_log.info("%s %s key=%s variant=%s v%s -> %d in %.0f ms", ctx.request_id, ctx.path, ctx.key.name,
                        label, attempt.version or "?", status, e2e * 1000)

    def _settle(self, ctx: RequestContext, usage: dict | None, generated: bool = True) -> None:
        """Give back what the reservation did not use: per the answer's usage; all of it when no replica
        generated anything (a refused request must not spend the budget of the corrected one that follows)."""
        if ctx.reservation is None:
            return
        total = usage.get("total_tokens") if isinstance(usage, dict) else None
        used = float(total) if isinstance(total, int) else (None if generated else 0.0)
        self.limiter.settle(ctx.reservation, used)


def _no_replica_error(exc: NoReplicaAvailable) -> GatewayError:
    """429 when every replica that answered was busy (their Retry-After, else 1 s); else 503."""
    if exc.all_rate_limited:
        retry_after = exc.retry_after or "1"
        return GatewayError(429, f"every replica is busy ({exc}); retry after {retry_after} s", "rate_limit_error",
                            "replicas_busy", headers={"retry-after": retry_after})
    return GatewayError(503, f"no replica could take the request ({exc})", "service_unavailable",
                        headers={"retry-after": "1"})


def _reject_reason(exc: GatewayError) -> str:
    return {401: "auth", 403: "forbidden", 404: "model", 429: "rate_limit"}.get(exc.status, "bad_request")
