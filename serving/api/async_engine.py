"""Runs the engine's step loop in one background thread and streams outputs to asyncio queues.

The event loop never blocks on the model: handlers call ``add`` (validation + inbox, cheap) and await
their queue; the engine thread steps while work exists and delivers each step's outputs with one
``call_soon_threadsafe``. Draining stops admission (503) and lets in-flight requests finish; ``abort_all``
ends those still running when the drain timeout runs out.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time

from serving.api.metrics import ServerMetrics
from serving.engine import EngineDrainingError, LLMEngine, RequestOutput, SamplingParams

log = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine thread failed; requests in flight get a 500 and /health turns 503."""


class RequestAbortedError(RuntimeError):
    """Put in a request's queue when the server ends it (the drain timeout ran out): the handler finishes
    the answer at once (a stream with finish_reason "abort", a non-streaming request with a 503)."""


class AsyncEngine:
    def __init__(self, engine: LLMEngine, metrics: ServerMetrics | None = None) -> None:
        self.engine = engine
        self.metrics = metrics
        self._queues: dict[str, asyncio.Queue] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake = threading.Event()
        self._stop = False
        self.draining = False
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="engine-step-loop", daemon=True)

    # ----------------------------------------------------------------- lifecycle
    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._thread.start()

    def stop(self) -> None:
        self._stop = True
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    def num_in_flight(self) -> int:
        return len(self._queues)

    def wait_idle(self, timeout: float) -> bool:
        """Block (in a plain thread) until no request is in flight; False on timeout."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self._queues and not self.engine.has_unfinished():
                return True
            time.sleep(0.05)
        return False

    # ----------------------------------------------------------------- requests (event-loop side)
    def add(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> asyncio.Queue:
        if self.draining:
            raise EngineDrainingError("server is shutting down; not accepting new requests")
        if not self.alive:
            raise EngineDeadError(f"engine is not running: {self.error}")
        q: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = q
        try:
            self.engine.add_request(request_id, prompt_token_ids, params)
        except BaseException:
            self._queues.pop(request_id, None)
            raise
        self._wake.set()
        return q

    def abort(self, request_id: str) -> None:
        if self._queues.pop(request_id, None) is not None:
            self.engine.abort(request_id)
            self._wake.set()

    def abort_all(self, reason: str) -> int:
        """End every request in flight: each handler gets ``RequestAbortedError`` and the engine frees the
        blocks. Event-loop side; from another thread use ``abort_all_threadsafe``."""
        queues, self._queues = self._queues, {}
        for request_id, q in queues.items():
            q.put_nowait(RequestAbortedError(reason))
            self.engine.abort(request_id)
        self._wake.set()
        return len(queues)

    def abort_all_threadsafe(self, reason: str) -> None:
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self.abort_all, reason)

    # ----------------------------------------------------------------- engine thread
    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for o in outputs:
            q = self._queues.get(o.request_id)
            if q is None:
                continue
            q.put_nowait(o)
            if o.finished:
                self._queues.pop(o.request_id, None)

    def _fail_all(self, err: BaseException) -> None:
        for q in list(self._queues.values()):
            q.put_nowait(err)
        self._queues.clear()

    def _run(self) -> None:
        while not self._stop:
            if not self.engine.has_unfinished():
                self._wake.wait(0.05)
                self._wake.clear()
                continue
            try:
                outputs = self.engine.step()
            except Exception as e:  # a bug or device failure: fail loudly, never hang clients
                log.exception("engine step failed")
                self.error = e
                if self._loop is not None:
                    self._loop.call_soon_threadsafe(self._fail_all, EngineDeadError(str(e)))
                return
            if not outputs:
                continue
            if self.metrics is not None:
                self.metrics.observe(outputs)
            if self._loop is not None and not self._loop.is_closed():
                self._loop.call_soon_threadsafe(self._deliver, outputs)
