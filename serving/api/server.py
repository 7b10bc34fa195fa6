"""OpenAI-compatible HTTP server over the engine (FastAPI + uvicorn).

Routes: /v1/completions, /v1/chat/completions (both with SSE streaming), /v1/models, /health, /ready,
/metrics. The server knows requests and streams; the engine knows sequences and blocks. Bad input is
always a 4xx with an OpenAI error body; a full queue is 429 with Retry-After; draining is 503.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import re
import signal
import threading
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import ValidationError

from serving.api.async_engine import AsyncEngine, EngineDeadError
from serving.api.metrics import ServerMetrics
from serving.api.protocol import ChatCompletionRequest, CompletionRequest, error_body, find_lone_surrogate
from serving.engine import (
    EngineConfig,
    EngineDrainingError,
    InvalidRequestError,
    LLMEngine,
    QueueFullError,
    RequestOutput,
    SamplingParams,
)
from serving.engine.generation_defaults import SamplingDefaults

log = logging.getLogger(__name__)


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.headers = status, message, type_, param, headers


def _err(e: APIError) -> JSONResponse:
    return JSONResponse(error_body(e.message, e.type, e.param, e.status), status_code=e.status, headers=e.headers)


@dataclass
class ServerState:
    engine: LLMEngine
    async_engine: AsyncEngine
    metrics: ServerMetrics
    model_name: str
    ready: bool = False


# ----------------------------------------------------------------------------- request → engine
def _pick(requested: Any, model_default: Any, openai_default: Any) -> Any:
    """The request's value, else the model's generation_config.json default, else OpenAI's."""
    if requested is not None:
        return requested
    return openai_default if model_default is None else model_default


def _sampling(req: Any, defaults: SamplingDefaults, max_tokens: int | None, logprobs: int | None,
              prompt_logprobs: int | None, choice: int) -> SamplingParams:
    seed = req.seed + choice if req.seed is not None else None
    stop = req.stop if isinstance(req.stop, list) else ([req.stop] if req.stop else [])
    return SamplingParams(
        temperature=_pick(req.temperature, defaults.temperature, 1.0),
        top_p=_pick(req.top_p, defaults.top_p, 1.0),
        top_k=_pick(req.top_k, defaults.top_k, 0), min_p=_pick(req.min_p, defaults.min_p, 0.0),
        max_tokens=max_tokens, min_tokens=req.min_tokens,
        stop=stop, stop_token_ids=req.stop_token_ids or [], ignore_eos=req.ignore_eos, seed=seed,
        logprobs=logprobs, prompt_logprobs=prompt_logprobs,
        presence_penalty=req.presence_penalty or 0.0, frequency_penalty=req.frequency_penalty or 0.0,
        repetition_penalty=_pick(req.repetition_penalty, defaults.repetition_penalty, 1.0),
        skip_special_tokens=req.skip_special_tokens, include_stop_str_in_output=req.include_stop_str_in_output)


def _finite(v: float | None) -> float | None:
    """JSON has no -inf: clamp like OpenAI servers do."""
    if v is None:
        return None
    return v if math.isfinite(v) else -9999.0


class _Handler:
    def __init__(self, state: ServerState) -> None:
        self.s = state
        self.tok = state.engine.tokenizer

    def tstr(self, tid: int) -> str:
        if self.tok is None:
            return str(tid)
        return self.tok.decode([tid], skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.s.model_name:
            raise APIError(404, f"The model `{name}` does not exist.", "not_found_error", "model")

    async def submit(self, rid: str, ids: list[int], params: SamplingParams) -> asyncio.Queue:
        try:
            return self.s.async_engine.add(rid, ids, params)
        except InvalidRequestError as e:
            raise APIError(400, str(e), param=str(e).split(":")[0]) from e
        except QueueFullError as e:
            self.s.metrics.rejected.labels(self.s.model_name, "queue_full").inc()
            raise APIError(429, str(e), "rate_limit_error",
                           headers={"Retry-After": str(max(1, math.ceil(e.retry_after)))}) from e
        except EngineDrainingError as e:
            self.s.metrics.rejected.labels(self.s.model_name, "draining").inc()
            raise APIError(503, str(e), "service_unavailable") from e
        except EngineDeadError as e:
            raise APIError(503, str(e), "service_unavailable") from e

    async def submit_all(self, base: str, prompts: list[list[int]], make) -> list[tuple[str, int, asyncio.Queue]]:
        """One engine request per (prompt, choice); on any failure abort those already added."""
        subs: list[tuple[str, int, asyncio.Queue]] = []
        try:
            for pi, ids in enumerate(prompts):
                for c in range(make.n):
                    rid = f"{base}-{uuid.uuid4().hex[:8]}-{pi}-{c}"  # unique even if a client reuses ids
                    subs.append((rid, pi, await self.submit(rid, ids, make(c))))
        except BaseException:
            for rid, _, _ in subs:
                self.s.async_engine.abort(rid)
            raise
        return subs

    @staticmethod
    async def next_output(q: asyncio.Queue) -> RequestOutput:
        item = await q.get()
        if isinstance(item, BaseException):
            raise APIError(500, f"engine failure: {item}", "server_error")
        if item.error is not None:  # this request failed inside the engine; the engine goes on
            raise APIError(500, f"the request failed while generating ({item.error})", "server_error")
        return item


def _parse(model_cls, body: Any):
    if not isinstance(body, dict):
        raise APIError(400, "request body must be a JSON object")
    try:
        return model_cls.model_validate(body)
    except ValidationError as e:
        # For a field that accepts several shapes pydantic reports one error per shape; the deepest one
        # names what the client most likely meant (`messages.0.content.0.text`, not `content.str`).
        worst = max(e.errors(), key=lambda err: len(_field_path(err.get("loc", ()))))
        loc = ".".join(_field_path(worst.get("loc", ()))) or None
        raise APIError(400, f"{loc}: {worst.get('msg')}" if loc else str(worst.get("msg")), param=loc) from e


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


def _field_path(loc: tuple) -> list[str]:
    """A pydantic error location without the union-member tags (`str`, `list[int]`) it interleaves."""
    return [str(x) for x in loc if not (isinstance(x, str) and ("[" in x or x in _TYPE_TAGS))]


async def _json_body(request: Request) -> Any:
    raw = await request.body()
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise APIError(400, f"malformed JSON body: {e}") from e
    where = find_lone_surrogate(body)
    if where is not None:
        raise APIError(400, f"{where}: contains a lone UTF-16 surrogate, which is not valid Unicode text",
                       param=where)
    return body


class _Factory:
    """Builds SamplingParams per choice; ``n`` choices become n engine requests."""

    def __init__(self, req: Any, defaults: SamplingDefaults, max_tokens: int | None, logprobs: int | None,
                 prompt_logprobs: int | None) -> None:
        self.req, self.n, self.defaults = req, req.n, defaults
        self.args = (max_tokens, logprobs, prompt_logprobs)
        try:
            self(0)  # validate once up front
        except InvalidRequestError as e:
            raise APIError(400, str(e), param=str(e).split(":")[0]) from e

    def __call__(self, choice: int) -> SamplingParams:
        return _sampling(self.req, self.defaults, *self.args, choice)


# ----------------------------------------------------------------------------- completions
def _completion_logprobs(h: _Handler, token_ids: list[int], recs: list[dict[int, float] | None],
                         text_offset0: int) -> dict[str, Any]:
    tokens, token_lps, tops, offsets = [], [], [], []
    off = text_offset0
    for tid, rec in zip(token_ids, recs):
        s = h.tstr(tid)
        tokens.append(s)
        offsets.append(off)
        off += len(s)
        if rec is None:
            token_lps.append(None)
            tops.append(None)
        else:
            token_lps.append(_finite(rec.get(tid)))
            top: dict[str, float] = {}
            for t, v in rec.items():
                top.setdefault(h.tstr(t), _finite(v))
            tops.append(top)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


async def completions(state: ServerState, request: Request) -> Any:
    h = _Handler(state)
    req: CompletionRequest = _parse(CompletionRequest, await _json_body(request))
    h.check_model(req.model)
    if req.suffix:
        raise APIError(400, "suffix: not supported", param="suffix")
    if req.best_of is not None and req.best_of != req.n:
        raise APIError(400, "best_of: only best_of == n is supported", param="best_of")
    p = req.prompt
    if isinstance(p, str):
        prompts_ids = [state.engine.encode(p)]
    elif isinstance(p, list) and p and all(isinstance(x, int) for x in p):
        prompts_ids = [list(p)]
    elif isinstance(p, list) and p and all(isinstance(x, str) for x in p):
        prompts_ids = [state.engine.encode(x) for x in p]
    elif isinstance(p, list) and p and all(isinstance(x, list) for x in p):
        prompts_ids = [list(x) for x in p]
    else:
        raise APIError(400, "prompt: must be a non-empty string, list of strings, or token id list(s)",
                       param="prompt")
    if req.echo and req.stream:
        raise APIError(400, "echo: not supported together with stream", param="echo")
    lp = req.logprobs
    make = _Factory(req, state.engine.sampling_defaults, req.max_tokens, lp,
                    lp if (req.echo and lp is not None) else None)
    rid = f"cmpl-{_request_id(request)}"
    created = int(time.time())
    subs = await h.submit_all(rid, prompts_ids, make)
    if req.stream:
        return StreamingResponse(_stream_completion(h, state, req, rid, created, subs, prompts_ids),
                                 media_type="text/event-stream", headers=_id_header(request))
    return JSONResponse(await _full_completion(h, state, request, req, rid, created, subs, prompts_ids),
                        headers=_id_header(request))


async def _wait_disconnect(request: Request) -> None:
    """Return when the client goes away (the body is already read, so the next message is the disconnect)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _gather(h: _Handler, state: ServerState, request: Request,
                  subs: list[tuple[str, int, asyncio.Queue]]) -> list[RequestOutput]:
    """Wait for every sub-request; a client that disconnects cancels them all at once."""
    async def one(q: asyncio.Queue) -> RequestOutput:
        while True:
            o = await h.next_output(q)
            if o.finished:
                return o

    tasks = [asyncio.ensure_future(one(q)) for _, _, q in subs]
    gone = asyncio.ensure_future(_wait_disconnect(request))
    try:
        pending = set(tasks)
        while pending:
            done, _ = await asyncio.wait(pending | {gone}, return_when=asyncio.FIRST_COMPLETED)
            if gone in done:
                raise asyncio.CancelledError()
            pending -= done
        return [t.result() for t in tasks]
    finally:
        gone.cancel()
        for t in tasks:
            t.cancel()
        for rid, _, _ in subs:
            state.async_engine.abort(rid)  # no-op for finished ones


_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:@/+=-]{1,128}$")


def _request_id(request: Request) -> str:
    """The client's (or the gateway's) ``X-Request-Id`` when it is a sane token, else a fresh one; the
    response ``id`` carries it, as vLLM's does, so one id follows a request through every hop."""
    given = request.headers.get("x-request-id")
    return given if given and _REQUEST_ID.match(given) else uuid.uuid4().hex


def _id_header(request: Request) -> dict[str, str]:
    given = request.headers.get("x-request-id")
    return {"x-request-id": given} if given and _REQUEST_ID.match(given) else {}


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


async def _full_completion(h, state, request, req, rid, created, subs, prompts_ids) -> dict[str, Any]:
    outs = await _gather(h, state, request, subs)
    choices = []
    for i, ((_, pi, _), o) in enumerate(zip(subs, outs)):
        text = o.text
        logprobs = None
        if req.echo:
            prompt_text = h.tok.decode(prompts_ids[pi], clean_up_tokenization_spaces=False) if h.tok else ""
            text = prompt_text + text
        if req.logprobs is not None:
            ids, recs = [], []
            if req.echo:
                ids += o.prompt_token_ids
                recs += (o.prompt_logprobs or [None] * len(ids))
            ids += o.token_ids
            recs += (o.outputs[0].logprobs or [None] * len(o.token_ids))
            logprobs = _completion_logprobs(h, ids, recs, 0)
        choices.append({"index": i, "text": text, "logprobs": logprobs, "finish_reason": o.finish_reason})
    ptoks = sum(len(prompts_ids[pi]) for (_, pi, _) in subs) // max(1, req.n)
    ctoks = sum(len(o.token_ids) for o in outs)
    return {"id": rid, "object": "text_completion", "created": created, "model": state.model_name,
            "choices": choices, "usage": _usage(ptoks, ctoks)}


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


async def _merge(h: _Handler, subs) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Yield (choice index, output) from all sub-requests as they arrive."""
    getters = {asyncio.ensure_future(h.next_output(q)): i for i, (_, _, q) in enumerate(subs)}
    try:
        while getters:
            done, _ = await asyncio.wait(getters, return_when=asyncio.FIRST_COMPLETED)
            for t in done:
                i = getters.pop(t)
                o = t.result()
                yield i, o
                if not o.finished:
                    getters[asyncio.ensure_future(h.next_output(subs[i][2]))] = i
    finally:
        for t in getters:
            t.cancel()


async def _stream_completion(h, state, req, rid, created, subs, prompts_ids) -> AsyncIterator[str]:
    finished: set[int] = set()
    ctoks = 0
    try:
        async for i, o in _merge(h, subs):
            ctoks += len(o.delta_token_ids)
            if not (o.delta_text or o.finished or o.delta_token_ids):
                continue
            lp = None
            if req.logprobs is not None and o.delta_logprobs:
                lp = _completion_logprobs(h, o.delta_token_ids, o.delta_logprobs, 0)
            choice = {"index": i, "text": o.delta_text, "logprobs": lp,
                      "finish_reason": o.finish_reason if o.finished else None}
            if o.finished:
                finished.add(i)
            yield _sse({"id": rid, "object": "text_completion", "created": created, "model": state.model_name,
                        "choices": [choice]})
        if req.stream_options and req.stream_options.include_usage:
            ptoks = sum(len(prompts_ids[pi]) for (_, pi, _) in subs) // max(1, req.n)
            yield _sse({"id": rid, "object": "text_completion", "created": created, "model": state.model_name,
                        "choices": [], "usage": _usage(ptoks, ctoks)})
        yield "data: [DONE]\n\n"
    except APIError as e:
        yield _sse(error_body(e.message, e.type, e.param, e.status))
    finally:
        _abort_unfinished(state, subs, finished)


def _abort_unfinished(state: ServerState, subs, finished: set[int]) -> None:
    """A stream that ends early (client gone, error) frees the KV blocks of the choices still running."""
    for j, (sub_id, _, _) in enumerate(subs):
        if j not in finished:
            state.async_engine.abort(sub_id)


# ----------------------------------------------------------------------------- chat
def _chat_prompt(state: ServerState, req: ChatCompletionRequest) -> list[int]:
    tok = state.engine.tokenizer
    if tok is None or not getattr(tok, "chat_template", None):
        raise APIError(400, "messages: this model has no chat template; use /v1/completions", param="messages")
    messages = []
    for i, m in enumerate(req.messages):
        content = m.content
        if isinstance(content, list):  # OpenAI content parts: the model reads the text ones
            for j, part in enumerate(content):
                if part.type == "text" and part.text is None:
                    raise APIError(400, f"messages.{i}.content.{j}.text: a text part needs a string `text`",
                                   param=f"messages.{i}.content.{j}.text")
            content = "".join(part.text or "" for part in content if part.type == "text")
        messages.append({"role": m.role, "content": content or ""})
    try:
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=req.add_generation_prompt,
                                       continue_final_message=req.continue_final_message)
    except Exception as e:  # template errors come from user content (jinja raise_exception)
        raise APIError(400, f"messages: chat template failed: {e}", param="messages") from e
    return tok.encode(text, add_special_tokens=False)


def _chat_logprobs(h: _Handler, token_ids: list[int], recs: list[dict[int, float]] | None,
                   top: int) -> dict[str, Any] | None:
    if recs is None:
        return None
    content = []
    for tid, rec in zip(token_ids, recs):
        s = h.tstr(tid)
        best = sorted(rec.items(), key=lambda kv: -kv[1])[:top]
        alts = [{"token": h.tstr(t), "logprob": _finite(v), "bytes": list(h.tstr(t).encode())} for t, v in best]
        content.append({"token": s, "logprob": _finite(rec.get(tid)), "bytes": list(s.encode()),
                        "top_logprobs": alts})
    return {"content": content}


async def chat_completions(state: ServerState, request: Request) -> Any:
    h = _Handler(state)
    req: ChatCompletionRequest = _parse(ChatCompletionRequest, await _json_body(request))
    h.check_model(req.model)
    ids = _chat_prompt(state, req)
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    top = req.top_logprobs or 0
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError(400, "top_logprobs: requires logprobs=true", param="top_logprobs")
    make = _Factory(req, state.engine.sampling_defaults, max_tokens, top if req.logprobs else None, None)
    rid = f"chatcmpl-{_request_id(request)}"
    created = int(time.time())
    subs = await h.submit_all(rid, [ids], make)
    if req.stream:
        return StreamingResponse(_stream_chat(h, state, req, rid, created, subs, len(ids), top),
                                 media_type="text/event-stream", headers=_id_header(request))
    outs = await _gather(h, state, request, subs)
    choices = [{"index": i, "message": {"role": "assistant", "content": o.text},
                "logprobs": _chat_logprobs(h, o.token_ids, o.outputs[0].logprobs, top) if req.logprobs else None,
                "finish_reason": o.finish_reason} for i, o in enumerate(outs)]
    body = {"id": rid, "object": "chat.completion", "created": created, "model": state.model_name,
            "choices": choices, "usage": _usage(len(ids), sum(len(o.token_ids) for o in outs))}
    return JSONResponse(body, headers=_id_header(request))


async def _stream_chat(h, state, req, rid, created, subs, n_prompt, top) -> AsyncIterator[str]:
    finished: set[int] = set()
    ctoks = 0
    head = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": state.model_name}
    try:
        for i in range(len(subs)):
            yield _sse({**head, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                             "logprobs": None, "finish_reason": None}]})
        async for i, o in _merge(h, subs):
            ctoks += len(o.delta_token_ids)
            if not (o.delta_text or o.finished):
                continue
            delta = {"content": o.delta_text} if o.delta_text else {}
            lp = _chat_logprobs(h, o.delta_token_ids, o.delta_logprobs, top) if req.logprobs else None
            if o.finished:
                finished.add(i)
            yield _sse({**head, "choices": [{"index": i, "delta": delta, "logprobs": lp,
                                             "finish_reason": o.finish_reason if o.finished else None}]})
        if req.stream_options and req.stream_options.include_usage:
            yield _sse({**head, "choices": [], "usage": _usage(n_prompt, ctoks)})
        yield "data: [DONE]\n\n"
    except APIError as e:
        yield _sse(error_body(e.message, e.type, e.param, e.status))
    finally:
        _abort_unfinished(state, subs, finished)


# ----------------------------------------------------------------------------- app
def build_app(engine: LLMEngine, model_name: str, *, warmup: bool = True) -> FastAPI:
    """The FastAPI app over an already loaded engine; the step thread starts with the app."""
    metrics = ServerMetrics(engine, model_name)
    state = ServerState(engine, AsyncEngine(engine, metrics), metrics, model_name)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        state.async_engine.start(asyncio.get_running_loop())
        if warmup:
            await _warmup(state)
        state.ready = True
        try:
            yield
        finally:
            state.ready = False
            state.async_engine.stop()

    app = FastAPI(title="llm-lifecycle engine", lifespan=lifespan)
    app.state.serving = state

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError):
        return _err(e)

    @app.exception_handler(InvalidRequestError)
    async def _invalid(request: Request, e: InvalidRequestError):
        return _err(APIError(400, str(e)))

    @app.exception_handler(404)
    async def _not_found(request: Request, e: Exception):
        return _err(APIError(404, f"no route {request.url.path}", "not_found_error"))

    @app.exception_handler(405)
    async def _bad_method(request: Request, e: Exception):
        return _err(APIError(405, f"method {request.method} not allowed on {request.url.path}"))

    @app.get("/health")
    async def health():
        if not state.async_engine.alive:
            return _err(APIError(503, f"engine stopped: {state.async_engine.error}", "service_unavailable"))
        return {"status": "ok"}

    @app.get("/ready")
    async def ready():
        if state.ready and not state.async_engine.draining and state.async_engine.alive:
            return {"ready": True}
        return JSONResponse({"ready": False, "draining": state.async_engine.draining}, status_code=503)

    @app.get("/metrics")
    async def metrics_route():
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
        return PlainTextResponse(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0,
                                            "owned_by": "llm-lifecycle", "max_model_len": engine.max_model_len}]}

    @app.post("/v1/completions")
    async def v1_completions(request: Request):
        return await completions(state, request)

    @app.post("/v1/chat/completions")
    async def v1_chat(request: Request):
        return await chat_completions(state, request)

    return app


async def _warmup(state: ServerState) -> None:
    """One short generation through the whole path so the first user request pays no cold start."""
    eng = state.engine
    ids = [eng.tokenizer.bos_token_id or 0] if eng.tokenizer is not None else [0]
    q = state.async_engine.add(f"warmup-{uuid.uuid4().hex}", ids * 4, SamplingParams(temperature=0, max_tokens=2,
                                                                                     ignore_eos=True))
    while True:
        o = await _Handler.next_output(q)
        if o.finished:
            return


# ----------------------------------------------------------------------------- process entry
def load_engine(model_dir: str | Path, engine_config: EngineConfig | None = None,
                verify: bool = True) -> LLMEngine:
    """Verify a bundle (a directory with manifest.json) in full, then load the engine.

    A bundle that fails verification raises the bundle engineer's BundleVerificationError and is
    never served. Plain HF model directories (no manifest.json) load directly.
    """
    path = Path(model_dir)
    if verify and (path / "manifest.json").is_file():
        from artifacts.verify import verify_bundle  # lazy: serving plain dirs needs no artifacts stack

        verify_bundle(path)
    engine = LLMEngine.from_pretrained(path, engine_config or EngineConfig())
    if engine.sampling_defaults.given():
        log.info("sampling defaults from %s/generation_config.json for fields a request leaves out: %s", path,
                 engine.sampling_defaults.given())
    return engine


def run_server(model_dir: str | Path, host: str = "127.0.0.1", port: int = 8000,
               engine_config: EngineConfig | None = None, served_model_name: str | None = None,
               drain_timeout_s: float = 30.0, log_level: str = "info", verify: bool = True) -> None:
    """Load, verify, warm up and serve until SIGTERM/SIGINT; SIGTERM drains in-flight requests first.

    /ready answers 200 only once loading, verification and the warm-up generation are done.
    """
    engine = load_engine(model_dir, engine_config, verify=verify)
    name = served_model_name or Path(model_dir).name
    app = build_app(engine, name)
    server = DrainingServer(uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=False),
                            app.state.serving, drain_timeout_s)
    server.run()


class DrainingServer(uvicorn.Server):
    """uvicorn server whose SIGTERM first drains: 503 for new requests, finish in-flight, then exit."""

    def __init__(self, config: uvicorn.Config, state: ServerState, drain_timeout_s: float = 30.0) -> None:
        super().__init__(config)
        self._state = state
        self._drain_timeout_s = drain_timeout_s
        self._draining_started = False

    def handle_exit(self, sig: int, frame: Any) -> None:
        if sig != signal.SIGTERM or self._draining_started:
            return super().handle_exit(sig, frame)
        self._draining_started = True
        self._state.async_engine.draining = True
        log.info("SIGTERM: draining %d in-flight requests", self._state.async_engine.num_in_flight())

        def finish() -> None:
            self._state.async_engine.wait_idle(self._drain_timeout_s)
            self.should_exit = True

        threading.Thread(target=finish, name="drain", daemon=True).start()
