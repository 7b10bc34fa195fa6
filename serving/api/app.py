"""The FastAPI app (vLLM's ``api_server`` routes): /v1/completions, /v1/chat/completions (both with SSE
streaming), /v1/models, /health, /ready, /metrics, and the OpenAPI document that describes them.

The server knows requests and streams; the engine knows sequences and blocks. Bad input is always a 4xx
with an OpenAI error body; a full queue is 429 with Retry-After; draining is 503.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request, Response
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, PlainTextResponse

from serving.api.chat import ChatServing
from serving.api.completion import CompletionServing
from serving.api.engine_client import EngineClient
from serving.api.engine_view import EngineView
from serving.api.errors import APIError, ClientDisconnectedError, engine_api_error, error_response
from serving.api.lora_routes import add_lora_routes, load_startup_adapters, model_card
from serving.api.metrics import ServerMetrics
from serving.api.openai_serving import next_output
from serving.api.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    ErrorResponse,
)
from serving.api.server_state import ServerState
from serving.api.thread_engine_client import ThreadEngineClient
from serving.engine import InvalidRequestError, SamplingParams

if TYPE_CHECKING:  # the API process of `lifecycle serve` never imports torch
    from serving.engine import LLMEngine

log = logging.getLogger(__name__)

# ----------------------------------------------------------------------------- OpenAPI
# The generation handlers read the raw body themselves (every bad body is an OpenAI-style 400, never
# FastAPI's 422), so their request schemas and answers are declared here rather than inferred.
_REQUEST_MODELS = (CompletionRequest, ChatCompletionRequest)


def _body(model: type) -> dict[str, Any]:
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}}


def _error(description: str, **extra: Any) -> dict[str, Any]:
    return {"model": ErrorResponse, "description": description, **extra}


_GENERATION_ERRORS: dict[int | str, dict[str, Any]] = {
    400: _error("Invalid request: malformed JSON, a field out of range, a prompt longer than the context."),
    404: _error("No such model (`model` names neither this server's model nor a loaded adapter: "
                "`model_not_found`)."),
    429: _error("The queue is full; retry after `Retry-After` seconds.",
                headers={"Retry-After": {"description": "seconds to wait", "schema": {"type": "integer"}}}),
    500: _error("This request failed while generating (the server goes on serving others)."),
    503: _error("The server is draining or shutting down, or the engine stopped."),
}
# One server-sent event: `data:` holds a JSON chunk (an error object if the request fails mid-stream, e.g.
# the server shutting down), and the last event's is `[DONE]`.
_SSE = {"text/event-stream": {"schema": {
    "type": "object", "required": ["data"],
    "properties": {"data": {"type": "string", "description": "a JSON chunk, an OpenAI error object, or [DONE]"}},
}}}


def _generation_responses(answer: type) -> dict[int | str, dict[str, Any]]:
    return {200: {"model": answer, "description": f"{answer.__name__}, or with `stream: true` server-sent "
                                                  "events (chunks, then `data: [DONE]`).", "content": _SSE},
            **_GENERATION_ERRORS}


def _openapi(app: FastAPI) -> dict[str, Any]:
    """FastAPI's document plus the request-body schemas (with every model they use) under components."""
    if app.openapi_schema is None:
        doc = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
        components = doc.setdefault("components", {}).setdefault("schemas", {})
        for model in _REQUEST_MODELS:
            schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
            components.update(schema.pop("$defs", {}))
            components[model.__name__] = schema
        app.openapi_schema = doc
    return app.openapi_schema


# ----------------------------------------------------------------------------- app
def build_app(engine: LLMEngine | EngineView, model_name: str, *, warmup: bool = True,
              client: EngineClient | None = None, admin_key: str | None = None,
              lora_modules: dict[str, str] | None = None, model_dir: str | None = None) -> FastAPI:
    """The FastAPI app over an already loaded engine: in this process (the step thread starts with the app),
    or, with ``client``, the engine-core process that client drives and ``engine`` views. ``lora_modules``:
    adapters (name -> directory) loaded before the server is ready; ``admin_key`` turns on the routes that
    load and unload them while serving."""
    metrics = ServerMetrics(engine, model_name)
    if client is None:
        client = ThreadEngineClient(engine, metrics)
    client.metrics = metrics
    state = ServerState(engine, client, metrics, model_name, admin_key=admin_key, model_dir=model_dir)
    app = FastAPI(title="llm-lifecycle engine", version="1", lifespan=_lifespan(state, warmup, lora_modules or {}),
                  description="OpenAI-compatible completions and chat over the continuous-batching engine.")
    app.state.serving = state
    app.openapi = lambda: _openapi(app)
    _add_error_handlers(app)
    _add_status_routes(app, state)
    _add_generation_routes(app, state)
    add_lora_routes(app, state)
    return app


def _lifespan(state: ServerState, warmup: bool, lora_modules: dict[str, str]):
    """Start the engine client with the app (load its adapters, warm it up), ready only then; stop it when the
    app stops."""
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        state.engine_client.start(asyncio.get_running_loop())
        await load_startup_adapters(state, lora_modules)
        if warmup:
            await _warmup(state)
        state.ready = True
        try:
            yield
        finally:
            state.ready = False
            state.engine_client.stop()

    return lifespan


def _add_error_handlers(app: FastAPI) -> None:
    """Every error as an OpenAI error body: ours, the engine's bad input, and FastAPI's own 404 and 405."""
    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError):
        return error_response(e)

    @app.exception_handler(InvalidRequestError)
    async def _invalid(request: Request, e: InvalidRequestError):
        return error_response(engine_api_error(e))

    @app.exception_handler(ClientDisconnectedError)
    async def _client_gone(request: Request, e: ClientDisconnectedError):
        log.info("%s", e)
        return Response(status_code=499)  # nginx's "client closed request"; nobody is there to read it

    @app.exception_handler(404)
    async def _not_found(request: Request, e: Exception):
        return error_response(APIError(404, f"no route {request.url.path}", "not_found_error"))

    @app.exception_handler(405)
    async def _bad_method(request: Request, e: Exception):
        return error_response(APIError(405, f"method {request.method} not allowed on {request.url.path}"))


def _add_status_routes(app: FastAPI, state: ServerState) -> None:
    """/health, /ready, /metrics and /v1/models: what the gateway, the fleet and Prometheus ask."""
    @app.get("/health", responses={503: _error("The engine stopped (its thread failed or its process died).")})
    async def health():
        if not state.engine_client.alive:
            return error_response(APIError(503, f"engine stopped: {state.engine_client.error}",
                                           "service_unavailable"))
        return {"status": "ok"}

    @app.get("/ready", responses={503: {"description": "Loading, warming up or draining: `{\"ready\": false, "
                                                       "\"draining\": …}`."}})
    async def ready():
        if state.ready and not state.engine_client.draining and state.engine_client.alive:
            return {"ready": True}
        return JSONResponse({"ready": False, "draining": state.engine_client.draining}, status_code=503)

    @app.get("/metrics", response_class=PlainTextResponse,
             responses={200: {"description": "Prometheus text exposition, vLLM's metric names (see docs/serving.md).",
                              "content": {"text/plain": {"schema": {"type": "string"}}}}})
    async def metrics_route():
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
        return PlainTextResponse(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        names = [state.model_name, *sorted(state.engine_client.adapters)]
        return {"object": "list", "data": [model_card(state, name) for name in names]}


def _add_generation_routes(app: FastAPI, state: ServerState) -> None:
    """/v1/completions and /v1/chat/completions, with the request and answer schemas the OpenAPI shows."""
    completions, chat = CompletionServing(state), ChatServing(state)

    @app.post("/v1/completions", openapi_extra=_body(CompletionRequest),
              responses=_generation_responses(CompletionResponse))
    async def v1_completions(request: Request):
        return await completions.create(request)

    @app.post("/v1/chat/completions", openapi_extra=_body(ChatCompletionRequest),
              responses=_generation_responses(ChatCompletionResponse))
    async def v1_chat(request: Request):
        return await chat.create(request)


async def _warmup(state: ServerState) -> None:
    """One short generation through the whole path so the first user request pays no cold start."""
    eng = state.engine
    ids = [eng.tokenizer.bos_token_id or 0] if eng.tokenizer is not None else [0]
    q = state.engine_client.add(f"warmup-{uuid.uuid4().hex}", ids * 4, SamplingParams(temperature=0, max_tokens=2,
                                                                                     ignore_eos=True))
    while True:
        o = await next_output(q)
        if o.finished:
            return
