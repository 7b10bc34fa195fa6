"""The gateway's FastAPI app: the OpenAI routes, health, metrics, and the admin API.

Admin API (admin key): ``GET /admin/routing`` (state and replica health), ``PUT /admin/routing`` (a partial
update; ``expected_generation`` makes it a compare-and-set, answered 409 when someone else changed the
state first), ``GET /admin/window?since=&until=`` (the evidence the rollout controller judges a step on),
``PUT /admin/replicas/{name}`` with ``{"url": ...}`` (a named replica says where it answers now: a Ray actor
after a restart) and ``DELETE /admin/replicas/{name}`` (it was stopped).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from serving.gateway.admission import authenticate, request_id_of
from serving.gateway.config import ConfigError, GatewayConfig
from serving.gateway.errors import GatewayError
from serving.gateway.keys import KeyStore
from serving.gateway.metrics import GatewayMetrics
from serving.gateway.observations import ObservationStore
from serving.gateway.proxy import Proxy
from serving.gateway.ratelimit import RateLimiter
from serving.gateway.replicas import ReplicaPools
from serving.gateway.routing import VARIANT_NAMES, Fault, RoutingState, RoutingStore, Variant, adapter_lane_from_json
from serving.gateway.shadow import ShadowMirror
from serving.gateway.upstream import Forwarder

log = logging.getLogger("serving.gateway")


def initial_state(config: GatewayConfig) -> RoutingState:
    def variant(v) -> Variant:
        return Variant(list(v.replicas), v.version, v.served_model)

    lanes = {public: adapter_lane_from_json({"champion": {"version": adapter.version,
                                                          "served_model": adapter.served_model}}, f"adapters.{public}.")
             for public, adapter in config.adapters.items()}
    state = RoutingState(champion=variant(config.champion), canary=variant(config.canary),
                         shadow=variant(config.shadow), baseline=variant(config.baseline),
                         canary_weight=config.canary_weight,
                         shadow_fraction=config.shadow_mirror.fraction, model_name=config.model_name,
                         lanes=lanes, updated_by="config")
    try:
        state.validate()
    except ValueError as exc:
        raise ConfigError(f"gateway config: {exc}") from None
    return state


def _tokenizer(config: GatewayConfig):
    """Count shadow divergence in model tokens when a tokenizer.json is configured, else in words."""
    if not config.tokenizer_file:
        return None
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(config.tokenizer_file)
    return lambda text: tok.encode(text, add_special_tokens=False).ids


class Gateway:
    """Everything one gateway process holds; built before the app so tests can reach it."""

    def __init__(self, config: GatewayConfig, seed: int | None = None) -> None:
        self.config = config
        self.keys = KeyStore.load(config.keys_file) if config.keys_file else None
        self.metrics = GatewayMetrics()
        self.routing = RoutingStore(config.state_path, initial_state(config))
        self.store = ObservationStore(config.state_path)
        self.pools = ReplicaPools(self.metrics, config.health.eject_after)
        self.rng = random.Random(seed)
        self.client: aiohttp.ClientSession | None = None
        self.proxy: Proxy | None = None
        self._sync()

    def _sync(self) -> None:
        state = self.routing.state
        self.pools.sync({name: state.variant(name).replicas for name in VARIANT_NAMES})
        self.metrics.canary_weight.set(state.canary_weight if state.canary.active else 0)
        self.metrics.baseline_weight.set(state.baseline_weight)
        self.metrics.shadow_fraction.set(state.shadow_fraction if state.shadow.active else 0)

    @asynccontextmanager
    async def lifespan(self, app: FastAPI):
        timeout = aiohttp.ClientTimeout(total=None, connect=self.config.connect_timeout_s,
                                        sock_read=self.config.upstream_timeout_s)
        self.client = aiohttp.ClientSession(timeout=timeout, auto_decompress=False, connector=aiohttp.TCPConnector(
            limit=2048, limit_per_host=0, keepalive_timeout=60, enable_cleanup_closed=True))
        fresh = aiohttp.ClientSession(timeout=timeout, auto_decompress=False,
                                      connector=aiohttp.TCPConnector(force_close=True))
        forwarder = Forwarder(self.client, self.pools, self.routing, self.store, self.metrics, self.rng, fresh)
        shadow = ShadowMirror(self.client, self.pools, self.routing, self.store, self.metrics,
                              self.config.shadow_mirror, _tokenizer(self.config))
        self.proxy = Proxy(self.config, self.keys, self.routing, forwarder, shadow, self.store, self.metrics,
                           RateLimiter(), self.rng)
        health = self.config.health
        poller = asyncio.create_task(self.pools.poll_forever(self.client, health.interval_s, health.timeout_s))
        restored = "restored from " + str(self.routing.path) if self.routing.restored else "from the config"
        log.info("gateway routing %s: champion %s, canary %s at %.1f%%, shadow %s", restored,
                 self.routing.state.champion.replicas, self.routing.state.canary.replicas,
                 self.routing.state.canary_weight, self.routing.state.shadow.replicas)
        try:
            yield
        finally:
            poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await poller
            await shadow.drain()
            await self.client.close()
            await fresh.close()
            self.store.close()

    # ----------------------------------------------------------------- admin
    def routing_view(self) -> dict[str, Any]:
        view = self.routing.state.to_json()
        view["public_model"] = self.routing.state.public_model
        view["replicas"] = [{"variant": r.variant, "url": r.url, "healthy": r.healthy, "failures": r.failures,
                             "in_flight": r.in_flight, "last_error": r.last_error, "max_model_len": r.max_model_len}
                            for r in self.pools.all()]
        return view

    def update_routing(self, patch: dict[str, Any], actor: str) -> dict[str, Any]:
        current = self._unchanged_since(patch.pop("expected_generation", None))
        _refuse_unknown_fields(patch, {*LANE_FIELDS, "model_name"})
        merged = current.to_json() | patch
        return self._replace(merged, actor, f"routing: {patch}")

    def update_lane(self, lane: str, patch: dict[str, Any] | None, actor: str) -> dict[str, Any]:
        """Change (or add) the adapter lane ``lane``; ``None`` removes it. The controller of an adapter rollout
        drives its lane as the base's controller drives the base routing."""
        current = self.routing.state
        merged = current.to_json()
        if patch is None:
            if lane not in merged["lanes"]:
                raise GatewayError(404, f"no adapter lane {lane!r}", "not_found_error", param="lane")
            del merged["lanes"][lane]
        else:
            self._unchanged_since(patch.pop("expected_generation", None))
            _refuse_unknown_fields(patch, set(LANE_FIELDS))
            merged["lanes"][lane] = merged["lanes"].get(lane, {}) | patch
        return self._replace(merged, actor, f"lane {lane}: {patch if patch is not None else 'removed'}")

    def _unchanged_since(self, expected: object) -> RoutingState:
        """The routing now, unless a compare-and-set's ``expected_generation`` is no longer it (409)."""
        current = self.routing.state
        if expected is not None and expected != current.generation:
            raise GatewayError(409, f"routing changed since generation {expected} (now {current.generation}); "
                               "read it again", "conflict_error", "generation_mismatch")
        return current

    def _replace(self, merged: dict[str, Any], actor: str, what: str) -> dict[str, Any]:
        try:
            new = RoutingState.from_json(merged)
        except (ValueError, TypeError) as exc:
            raise GatewayError(400, f"routing: {exc}") from None
        self.routing.replace(new, actor)
        self._sync()
        log.info("routing generation %d set by %s: %s", new.generation, actor, what)
        return self.routing_view()

    def register_replica(self, name: str, url: object, actor: str) -> dict[str, Any]:
        """A named replica answers at ``url``: routed there wherever its previous address was."""
        if not isinstance(url, str):
            raise GatewayError(400, "url: a string is required", param="url")
        new = RoutingState.from_json(self.routing.state.to_json())
        try:
            moved_from = new.register(name, url)
        except ValueError as exc:
            raise GatewayError(400, str(exc), param="url") from None
        if new.replica_names != self.routing.state.replica_names or moved_from:
            self.routing.replace(new, actor)
            self._sync()
        if moved_from:
            log.warning("replica %s moved from %s to %s (registered by %s)", name, moved_from, new.replica_names[name],
                        actor)
        return {"name": name, "url": new.replica_names[name], "moved_from": moved_from}

    def forget_replica(self, name: str, actor: str) -> dict[str, Any]:
        new = RoutingState.from_json(self.routing.state.to_json())
        new.forget(name)
        if new.replica_names != self.routing.state.replica_names:
            self.routing.replace(new, actor)
        return {"name": name, "forgotten": True}


def build_gateway_app(config: GatewayConfig, seed: int | None = None) -> FastAPI:
    gateway = Gateway(config, seed)
    app = FastAPI(title="llm-lifecycle gateway", lifespan=gateway.lifespan)
    app.state.gateway = gateway

    @app.exception_handler(GatewayError)
    async def _gateway_error(request: Request, exc: GatewayError):
        return exc.response(request_id_of(request))

    @app.exception_handler(404)
    async def _not_found(request: Request, exc: Exception):
        return GatewayError(404, f"no route {request.url.path}", "not_found_error").response()

    @app.exception_handler(405)
    async def _bad_method(request: Request, exc: Exception):
        return GatewayError(405, f"method {request.method} not allowed on {request.url.path}").response()

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await gateway.proxy.handle(request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await gateway.proxy.handle(request, "/v1/chat/completions")

    @app.get("/v1/models")
    async def models(request: Request):
        """The public model and each adapter lane, with the base as its ``parent`` (as vLLM lists adapters)."""
        authenticate(request, gateway.keys)
        state = gateway.routing.state
        cards = [{"id": state.public_model, "object": "model", "created": 0, "owned_by": "llm-lifecycle-gateway",
                  "parent": None}]
        cards += [{"id": name, "object": "model", "created": 0, "owned_by": "llm-lifecycle-gateway",
                   "parent": state.public_model} for name in sorted(state.lanes)]
        return {"object": "list", "data": cards}

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/ready")
    async def ready():
        if gateway.pools.healthy("champion"):
            return {"ready": True}
        return JSONResponse({"ready": False, "reason": "no healthy champion replica"}, status_code=503)

    @app.get("/metrics")
    async def metrics():
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return PlainTextResponse(generate_latest(gateway.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/admin/routing")
    async def get_routing(request: Request):
        authenticate(request, gateway.keys, admin=True)
        return gateway.routing_view()

    @app.put("/admin/routing")
    async def put_routing(request: Request):
        key = authenticate(request, gateway.keys, admin=True)
        return gateway.update_routing(await _json_object(request), _actor(request, key))

    @app.put("/admin/lanes/{lane}")
    async def put_lane(lane: str, request: Request):
        key = authenticate(request, gateway.keys, admin=True)
        return gateway.update_lane(lane, await _json_object(request), _actor(request, key))

    @app.delete("/admin/lanes/{lane}")
    async def delete_lane(lane: str, request: Request):
        key = authenticate(request, gateway.keys, admin=True)
        return gateway.update_lane(lane, None, _actor(request, key))

    @app.put("/admin/replicas/{name}")
    async def register_replica(name: str, request: Request):
        key = authenticate(request, gateway.keys, admin=True)
        body = await _json_object(request)
        return gateway.register_replica(name, body.get("url"), _actor(request, key))

    @app.delete("/admin/replicas/{name}")
    async def forget_replica(name: str, request: Request):
        key = authenticate(request, gateway.keys, admin=True)
        return gateway.forget_replica(name, _actor(request, key))

    @app.get("/admin/window")
    async def window(request: Request, since: float, until: float | None = None, disagreements: int = 10,
                     lane: str = ""):
        authenticate(request, gateway.keys, admin=True)
        return await asyncio.to_thread(gateway.store.window, since, until, max(0, min(disagreements, 100)), lane)

    return app


LANE_FIELDS = (*VARIANT_NAMES, "canary_weight", "shadow_fraction", "split_salt", "faults")


def _refuse_unknown_fields(patch: dict[str, Any], allowed: set[str]) -> None:
    unknown = sorted(set(patch) - allowed)
    if unknown:
        raise GatewayError(400, f"{unknown[0]}: not a routing field (fields: {', '.join(sorted(allowed))})",
                           param=unknown[0])


async def _json_object(request: Request) -> dict[str, Any]:
    try:
        body = await request.json()
    except ValueError:
        raise GatewayError(400, "body must be a JSON object") from None
    if not isinstance(body, dict):
        raise GatewayError(400, "body must be a JSON object")
    return body


def _actor(request: Request, key) -> str:
    """Who changed the routing, for its record: the caller's word (``X-Lifecycle-Actor``), else its key's name."""
    return request.headers.get("x-lifecycle-actor") or key.name


__all__ = ["Fault", "Gateway", "build_gateway_app"]
