"""What the completion and chat handlers share (vLLM's ``serving_engine``): errors, request parsing,
sampling parameters, and the engine side of one API request.

An API request with ``n`` choices over ``p`` prompts becomes ``n * p`` engine requests (``SubRequest``),
gathered back into one answer or merged into one stream. Whatever way the answer ends (finished, error,
client gone, server shutting down), the engine requests still running are aborted, so their KV blocks
are freed at the next step.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import re
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError

from serving.api.async_engine import EngineClient, EngineDeadError, RequestAbortedError
from serving.api.metrics import ServerMetrics
from serving.api.protocol import error_body, find_lone_surrogate
from serving.engine import (
    EngineDrainingError,
    InvalidRequestError,
    LLMEngine,
    QueueFullError,
    RequestOutput,
    SamplingParams,
)
from serving.engine.generation_defaults import SamplingDefaults

if TYPE_CHECKING:
    from serving.api.engine_client import EngineView

log = logging.getLogger(__name__)


# ----------------------------------------------------------------------------- errors
class APIError(Exception):
    """Answered as an OpenAI error body with ``status``."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.headers = status, message, type_, param, headers


class ClientDisconnectedError(Exception):
    """The client of a non-streaming request went away before the answer; its engine requests are aborted.

    Routine (a client timeout), so it is logged as one INFO line, never as an exception in the app.
    """

    def __init__(self, request_id: str, aborted: int) -> None:
        super().__init__(f"{request_id}: client disconnected; aborted {aborted} engine request(s)")
        self.request_id, self.aborted = request_id, aborted


def error_response(e: APIError) -> JSONResponse:
    return JSONResponse(error_body(e.message, e.type, e.param, e.status), status_code=e.status, headers=e.headers)


# ----------------------------------------------------------------------------- state and records
@dataclass
class ServerState:
    engine: LLMEngine | EngineView  # what the handlers read about the engine (tokenizer, defaults, limits)
    async_engine: EngineClient  # where requests go: a step thread here, or the engine-core process
    metrics: ServerMetrics
    model_name: str
    ready: bool = False


@dataclass
class SubRequest:
    """One engine request: choice ``index`` of the answer, generated from prompt ``prompt_index``."""

    request_id: str
    index: int
    prompt_index: int
    queue: asyncio.Queue
    finished: bool = False


@dataclass
class Generation:
    """The engine work of one API request: ``n`` sub-requests for each prompt."""

    id: str  # the answer's id: cmpl-… / chatcmpl-…
    created: int
    prompts: list[list[int]]
    subs: list[SubRequest]

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)


# ----------------------------------------------------------------------------- request parsing
_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


def _field_path(loc: tuple) -> list[str]:
    """A pydantic error location without the union-member tags (`str`, `list[int]`) it interleaves."""
    return [str(x) for x in loc if not (isinstance(x, str) and ("[" in x or x in _TYPE_TAGS))]


def parse_request(model_cls: type[BaseModel], body: Any) -> Any:
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


async def read_json_body(request: Request) -> Any:
    """The body as JSON. Parsed here, not by FastAPI, so every bad body is an OpenAI-style 400 (never a 422)."""
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


_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:@/+=-]{1,128}$")


def request_id(request: Request) -> str:
    """The client's (or the gateway's) ``X-Request-Id`` when it is a sane token, else a fresh one; the
    response ``id`` carries it, as vLLM's does, so one id follows a request through every hop."""
    given = request.headers.get("x-request-id")
    return given if given and _REQUEST_ID.match(given) else uuid.uuid4().hex


def id_header(request: Request) -> dict[str, str]:
    given = request.headers.get("x-request-id")
    return {"x-request-id": given} if given and _REQUEST_ID.match(given) else {}


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


SSE_DONE = "data: [DONE]\n\n"


class TokenIdsOut:
    """`return_token_ids` for a stream: the prompt's ids once per choice, and each chunk's new token ids.

    Tokens whose text the detokenizer still holds back (half a UTF-8 character, a possible stop string) ride
    with the next chunk that carries text, so the ids a client has seen are always the ids of the text it has
    seen: a gateway that continues from them neither repeats nor drops a token."""

    def __init__(self, enabled: bool, gen: Generation) -> None:
        self.enabled = enabled
        self.gen = gen
        self._pending: dict[int, list[int]] = {}
        self._prompt_sent: set[int] = set()

    def add(self, sub: SubRequest, token_ids: list[int]) -> None:
        if self.enabled:
            self._pending.setdefault(sub.index, []).extend(token_ids)

    def take(self, sub: SubRequest) -> dict[str, list[int]]:
        if not self.enabled:
            return {}
        return {"token_ids": self._pending.pop(sub.index, [])}

    def prompt(self, sub: SubRequest) -> dict[str, list[int]]:
        if not self.enabled or sub.index in self._prompt_sent:
            return {}
        self._prompt_sent.add(sub.index)
        return {"prompt_token_ids": list(self.gen.prompts[sub.prompt_index])}


def finite(v: float | None) -> float | None:
    """JSON has no -inf: clamp like OpenAI servers do."""
    if v is None:
        return None
    return v if math.isfinite(v) else -9999.0


# ----------------------------------------------------------------------------- sampling
def _pick(requested: Any, model_default: Any, openai_default: Any) -> Any:
    """The request's value, else the model's generation_config.json default, else OpenAI's."""
    if requested is not None:
        return requested
    return openai_default if model_default is None else model_default


class SamplingFactory:
    """SamplingParams for each choice (choice i samples with seed + i); ``n`` choices, n engine requests."""

    def __init__(self, req: Any, defaults: SamplingDefaults, max_tokens: int | None, logprobs: int | None,
                 prompt_logprobs: int | None) -> None:
        self.req, self.n, self.defaults = req, req.n, defaults
        self.max_tokens, self.logprobs, self.prompt_logprobs = max_tokens, logprobs, prompt_logprobs
        try:
            self(0)  # validate once up front
        except InvalidRequestError as e:
            raise APIError(400, str(e), param=str(e).split(":")[0]) from e

    def __call__(self, choice: int) -> SamplingParams:
        req, d = self.req, self.defaults
        stop = req.stop if isinstance(req.stop, list) else ([req.stop] if req.stop else [])
        return SamplingParams(
            temperature=_pick(req.temperature, d.temperature, 1.0), top_p=_pick(req.top_p, d.top_p, 1.0),
            top_k=_pick(req.top_k, d.top_k, 0), min_p=_pick(req.min_p, d.min_p, 0.0),
            max_tokens=self.max_tokens, min_tokens=req.min_tokens,
            stop=stop, stop_token_ids=req.stop_token_ids or [], ignore_eos=req.ignore_eos,
            seed=req.seed + choice if req.seed is not None else None,
            logprobs=self.logprobs, prompt_logprobs=self.prompt_logprobs,
            presence_penalty=req.presence_penalty or 0.0, frequency_penalty=req.frequency_penalty or 0.0,
            repetition_penalty=_pick(req.repetition_penalty, d.repetition_penalty, 1.0),
            skip_special_tokens=req.skip_special_tokens, include_stop_str_in_output=req.include_stop_str_in_output)


# ----------------------------------------------------------------------------- the engine side
async def next_output(q: asyncio.Queue) -> RequestOutput:
    item = await q.get()
    if isinstance(item, RequestAbortedError):
        # the server is shutting down (drain timeout): a 503, or in a stream an error event then [DONE],
        # which our gateway takes as a broken stream and continues on another replica
        raise APIError(503, str(item), "service_unavailable")
    if isinstance(item, EngineDeadError):
        raise APIError(503, str(item), "service_unavailable")
    if isinstance(item, InvalidRequestError):
        raise APIError(400, str(item), param=str(item).split(":")[0])
    if isinstance(item, QueueFullError):  # the engine core's own queue filled before the request arrived
        raise APIError(429, str(item), "rate_limit_error",
                       headers={"Retry-After": str(max(1, math.ceil(item.retry_after)))})
    if isinstance(item, BaseException):
        raise APIError(500, f"engine failure: {item}", "server_error")
    if item.error is not None:  # this request failed inside the engine; the engine goes on
        raise APIError(500, f"the request failed while generating ({item.error})", "server_error")
    return item


async def _wait_disconnect(request: Request) -> None:
    """Return when the client goes away (the body is already read, so the next message is the disconnect)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


class OpenAIServing:
    """Base of the completion and chat handlers: one per app, over the server's state."""

    def __init__(self, state: ServerState) -> None:
        self.state = state
        self.tok = state.engine.tokenizer

    def token_str(self, tid: int) -> str:
        if self.tok is None:
            return str(tid)
        return self.tok.decode([tid], skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.state.model_name:
            raise APIError(404, f"The model `{name}` does not exist.", "not_found_error", "model")

    async def read(self, request: Request, model_cls: type[BaseModel]) -> Any:
        """The body as a ``model_cls`` request for this server's model (an APIError, 400 or 404, if not)."""
        req = parse_request(model_cls, await read_json_body(request))
        self.check_model(req.model)
        return req

    @staticmethod
    def respond(request: Request, answer: dict[str, Any] | AsyncIterator[str]) -> Response:
        """The whole answer as JSON, or a stream of SSE events; either carries the client's X-Request-Id back."""
        if isinstance(answer, dict):
            return JSONResponse(answer, headers=id_header(request))
        return StreamingResponse(answer, media_type="text/event-stream", headers=id_header(request))

    def _submit(self, rid: str, ids: list[int], params: SamplingParams) -> asyncio.Queue:
        s = self.state
        try:
            return s.async_engine.add(rid, ids, params)
        except InvalidRequestError as e:
            raise APIError(400, str(e), param=str(e).split(":")[0]) from e
        except QueueFullError as e:
            s.metrics.rejected.labels(s.model_name, "queue_full").inc()
            raise APIError(429, str(e), "rate_limit_error",
                           headers={"Retry-After": str(max(1, math.ceil(e.retry_after)))}) from e
        except EngineDrainingError as e:
            s.metrics.rejected.labels(s.model_name, "draining").inc()
            raise APIError(503, str(e), "service_unavailable") from e
        except EngineDeadError as e:
            raise APIError(503, str(e), "service_unavailable") from e

    def start(self, request: Request, kind: str, prompts: list[list[int]], make: SamplingFactory) -> Generation:
        """One engine request per (prompt, choice); on any failure abort those already added.

        The answer's id is ``<kind>-<request id>`` (``cmpl``, ``chatcmpl``)."""
        answer_id = f"{kind}-{request_id(request)}"
        gen = Generation(answer_id, int(time.time()), prompts, [])
        try:
            for pi, ids in enumerate(prompts):
                for c in range(make.n):
                    rid = f"{answer_id}-{uuid.uuid4().hex[:8]}-{pi}-{c}"  # unique even if a client reuses ids
                    gen.subs.append(SubRequest(rid, len(gen.subs), pi, self._submit(rid, ids, make(c))))
        except BaseException:
            self.abort_unfinished(gen)
            raise
        return gen

    def abort_unfinished(self, gen: Generation) -> int:
        """Abort the sub-requests still running (their KV blocks are freed at the next step); how many."""
        n = 0
        for sub in gen.subs:
            if not sub.finished:
                sub.finished = True
                self.state.async_engine.abort(sub.request_id)
                n += 1
        return n

    async def gather(self, gen: Generation, request: Request) -> list[RequestOutput]:
        """Every sub-request's final output, in choice order. A client that disconnects first aborts them
        all at once and raises ClientDisconnectedError."""
        async def one(sub: SubRequest) -> RequestOutput:
            while True:
                o = await next_output(sub.queue)
                if o.finished:
                    sub.finished = True
                    return o

        tasks = [asyncio.ensure_future(one(sub)) for sub in gen.subs]
        gone = asyncio.ensure_future(_wait_disconnect(request))
        try:
            pending = set(tasks)
            while pending:
                done, _ = await asyncio.wait(pending | {gone}, return_when=asyncio.FIRST_COMPLETED)
                if gone in done:
                    raise ClientDisconnectedError(gen.id, self.abort_unfinished(gen))
                pending -= done
                for t in done:
                    t.result()  # an error in one choice answers the whole request now
            return [t.result() for t in tasks]
        finally:
            gone.cancel()
            for t in tasks:
                t.cancel()
            self.abort_unfinished(gen)

    async def merge(self, gen: Generation) -> AsyncIterator[tuple[SubRequest, RequestOutput]]:
        """(sub-request, output) from all sub-requests as the outputs arrive."""
        getters = {asyncio.ensure_future(next_output(sub.queue)): sub for sub in gen.subs}
        try:
            while getters:
                done, _ = await asyncio.wait(getters, return_when=asyncio.FIRST_COMPLETED)
                for t in done:
                    sub = getters.pop(t)
                    o = t.result()
                    if o.finished:
                        sub.finished = True
                    yield sub, o
                    if not o.finished:
                        getters[asyncio.ensure_future(next_output(sub.queue))] = sub
        finally:
            for t in getters:
                t.cancel()

    def head(self, gen: Generation, kind: str) -> dict[str, Any]:
        """What every answer and every stream chunk starts with: id, object (``kind``), created, model."""
        return {"id": gen.id, "object": kind, "created": gen.created, "model": self.state.model_name}

    def answer(self, gen: Generation, kind: str, choices: list[dict[str, Any]],
               outs: list[RequestOutput]) -> dict[str, Any]:
        """A whole (non-streamed) answer: the head, the choices and the token usage of ``outs``."""
        return {**self.head(gen, kind), "choices": choices,
                "usage": usage(gen.prompt_tokens, sum(len(o.token_ids) for o in outs))}

    async def sse_stream(self, gen: Generation, kind: str, ids: TokenIdsOut, include_usage: bool,
                         chunk: Callable[[SubRequest, RequestOutput], dict[str, Any] | None],
                         opening: Callable[[], Iterable[dict[str, Any]]] = tuple) -> AsyncIterator[str]:
        """The SSE body of a streamed answer: ``opening()`` chunks, then ``chunk(sub, output)`` for each engine
        output (None: nothing to send yet), the usage chunk when asked, and ``[DONE]``.

        Each chunk is merged over the head (id, object ``kind``, created, model). An engine failure or the
        server shutting down (an APIError, 503) is sent as an error event before ``[DONE]``; whatever way the
        stream ends, the engine requests still running are aborted."""
        head = self.head(gen, kind)
        ctoks = 0
        ended = False
        try:
            for body in opening():
                yield sse({**head, **body})
            async for sub, o in self.merge(gen):
                ctoks += len(o.delta_token_ids)
                ids.add(sub, o.delta_token_ids)
                body = chunk(sub, o)
                if body is not None:
                    yield sse({**head, **body})
            if include_usage:
                yield sse({**head, "choices": [], "usage": usage(gen.prompt_tokens, ctoks)})
            ended = True
            yield SSE_DONE
        except APIError as e:  # an engine failure, or the server shutting down (503): say so, then end
            ended = True
            yield sse(error_body(e.message, e.type, e.param, e.status))
            yield SSE_DONE
        finally:
            self.stream_ended_early(gen, ended)

    def stream_ended_early(self, gen: Generation, ended: bool) -> None:
        """The `finally` of every stream: abort what still runs; a stream that did not reach its end (the
        client went away, or the server cancelled it) is logged as an abort, one INFO line."""
        n = self.abort_unfinished(gen)
        if n and not ended:
            log.info("%s: stream cancelled (client disconnected); aborted %d engine request(s)", gen.id, n)
