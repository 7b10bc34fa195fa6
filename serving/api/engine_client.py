"""The handlers' side of the engine: per-request asyncio queues fed by a step loop that runs elsewhere.

The event loop never blocks on the model: handlers call ``add`` (validation + hand-over, cheap) and await
their queue; the engine steps while work exists (in a thread here, ``thread_engine_client``, or in its own
process, ``process_engine_client``) and each step's outputs reach the loop with one ``call_soon_threadsafe``.
Draining stops admission (503) and lets in-flight requests finish; ``abort_all`` ends those still running
when the drain timeout runs out.
"""

from __future__ import annotations

import asyncio
import time

from serving.api.metrics import ServerMetrics
from serving.engine import EngineDrainingError, InvalidRequestError, RequestOutput, SamplingParams
from serving.engine.lora_info import AdapterInfo


class EngineDeadError(RuntimeError):
    """The engine stopped (its thread failed, or its process died); requests in flight get a 503 and
    /health and /ready turn 503."""


class RequestAbortedError(RuntimeError):
    """Put in a request's queue when the server ends it (the drain timeout ran out): the handler finishes
    the answer at once (a stream with finish_reason "abort", a non-streaming request with a 503)."""


class EngineClient:
    """What the handlers talk to: one asyncio queue of outputs per engine request, over an engine that steps
    elsewhere: a thread of this process (``ThreadEngineClient``) or the engine-core process
    (``ProcessEngineClient``). Outputs are delivered on the event loop with one
    ``call_soon_threadsafe`` per step."""

    def __init__(self, metrics: ServerMetrics | None = None) -> None:
        self.metrics = metrics
        self.adapters: dict[str, AdapterInfo] = {}  # the LoRA adapters requests may name, as last reported
        self._queues: dict[str, asyncio.Queue] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self.draining = False
        self.error: BaseException | None = None
        # the engine died of a device error (serving.engine.device_errors): the server exits so the fleet
        # replaces the replica; ``on_fatal`` (set by the server) is called on the event loop when it happens
        self.fatal = False
        self.on_fatal = None

    # ----------------------------------------------------------------- what each kind provides
    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError

    @property
    def alive(self) -> bool:
        raise NotImplementedError

    def _send_add(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                  lora: str | None = None) -> None:
        """Hand a request to the engine; raises InvalidRequestError / QueueFullError (400 / 429)."""
        raise NotImplementedError

    async def load_lora(self, name: str, path: str) -> list[AdapterInfo]:
        """Load a LoRA adapter while serving; the loaded adapters afterwards. Raises LoraError (400)."""
        raise NotImplementedError

    async def unload_lora(self, name: str) -> list[AdapterInfo]:
        """Refuse new requests for an adapter; raises UnknownAdapterError (404)."""
        raise NotImplementedError

    def _send_abort(self, request_id: str) -> None:
        raise NotImplementedError

    def _engine_busy(self) -> bool:
        return False

    # ----------------------------------------------------------------- requests (event-loop side)
    def num_in_flight(self) -> int:
        return len(self._queues)

    def wait_idle(self, timeout: float) -> bool:
        """Block (in a plain thread) until no request is in flight; False on timeout."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self._queues and not self._engine_busy():
                return True
            time.sleep(0.05)
        return False

    def add(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
            lora: str | None = None) -> asyncio.Queue:
        if self.draining:
            raise EngineDrainingError("server is shutting down; not accepting new requests")
        if not self.alive:
            raise EngineDeadError(f"engine is not running: {self.error}")
        if request_id in self._queues:
            raise InvalidRequestError(f"request_id: {request_id!r} is already in use")
        q: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = q
        try:
            self._send_add(request_id, prompt_token_ids, params, lora)
        except BaseException:
            self._queues.pop(request_id, None)
            raise
        return q

    def abort(self, request_id: str) -> None:
        if self._queues.pop(request_id, None) is not None:
            self._send_abort(request_id)

    def abort_all(self, reason: str) -> int:
        """End every request in flight: each handler gets ``RequestAbortedError`` and the engine frees the
        blocks. Event-loop side; from another thread use ``abort_all_threadsafe``."""
        queues, self._queues = self._queues, {}
        for request_id, q in queues.items():
            q.put_nowait(RequestAbortedError(reason))
            self._send_abort(request_id)
        return len(queues)

    def abort_all_threadsafe(self, reason: str) -> None:
        self._call_soon(self.abort_all, reason)

    # ----------------------------------------------------------------- delivery (any thread -> event loop)
    def _call_soon(self, fn, *args) -> None:
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(fn, *args)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for o in outputs:
            q = self._queues.get(o.request_id)
            if q is None:
                continue
            q.put_nowait(o)
            if o.finished:
                self._queues.pop(o.request_id, None)

    def _fail_one(self, request_id: str, err: BaseException) -> None:
        q = self._queues.pop(request_id, None)
        if q is not None:
            q.put_nowait(err)

    def _fail_all(self, err: BaseException) -> None:
        for q in list(self._queues.values()):
            q.put_nowait(err)
        self._queues.clear()

    def _died(self, err: EngineDeadError, fatal: bool = False) -> None:
        """The engine stopped for good (any thread): fail what is in flight; /health and /ready turn 503.
        ``fatal`` (a device error): then tell the server, which exits once those answers are written."""
        self.error = err
        self.fatal = fatal
        self._call_soon(self._fail_all, err)
        if fatal and self.on_fatal is not None:
            self._call_soon(self.on_fatal)
