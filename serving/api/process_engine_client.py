"""The API process's side of the process split: start the engine core, feed it, read its outputs.

``ProcessEngineClient`` is the ``EngineClient`` the handlers use when the engine runs in its own process
(``serving.engine.core_process``). Two threads keep the event loop off the pipe in both directions: a
writer sends what the handlers queued (several messages in one write when they pile up), a reader takes
each step's outputs off the pipe and hands them to the loop. The core sends what each step added to a request
(``serving.engine.output_deltas``); the reader assembles the full ``RequestOutput`` the handlers and the
metrics read, from the prompt and parameters sent and the deltas so far. Requests are validated here, against
the limits the core reported when it started, so a bad request is answered 400 without crossing over.

If the core process dies, every request in flight ends with a 503, /health and /ready turn 503, and nothing
hangs; if it died of a device error, the server then exits non-zero (``serving.engine.device_errors``).
What the handlers read about that engine (tokenizer, defaults, limits, stats) is ``engine_view.EngineView``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import multiprocessing
import queue
import signal
import threading
import time
import uuid
from pathlib import Path

from serving.api.engine_client import EngineClient, EngineDeadError
from serving.engine.config import EngineConfig
from serving.engine.core_process import (
    AbortRequest,
    AddRequest,
    CoreFailed,
    CoreReady,
    CoreStep,
    LoadLora,
    LoraReply,
    RequestRejected,
    Shutdown,
    UnloadLora,
    run_engine_core,
)
from serving.engine.errors import ModelLoadError, QueueFullError
from serving.engine.limits import validate_request
from serving.engine.lora_info import AdapterInfo
from serving.engine.output_deltas import OutputAssembler
from serving.engine.outputs import RequestOutput
from serving.engine.sampling_params import SamplingParams

log = logging.getLogger(__name__)

_STOP_GRACE_S = 10.0


class ProcessEngineClient(EngineClient):
    """The engine core in a child process, driven over a pipe."""

    def __init__(self, model_dir: Path, config: EngineConfig, log_level: str = "warning",
                 startup_timeout_s: float = 600.0) -> None:
        super().__init__()
        ctx = multiprocessing.get_context("spawn")  # a fresh interpreter: no forked torch or event-loop state
        self._conn, child_conn = ctx.Pipe(duplex=True)
        self._proc = ctx.Process(target=run_engine_core, name="engine-core", daemon=True,
                                 args=(str(model_dir), config, child_conn, log_level))
        self._proc.start()
        child_conn.close()
        ready = self._wait_ready(startup_timeout_s)
        self.pid, self.limits, self.last_stats = ready.pid, ready.limits, ready.stats
        self.tokenizer_class = ready.tokenizer_class
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._unstarted: set[str] = set()  # sent, no output yet: the API side's view of the waiting queue
        self._assembler = OutputAssembler()  # sent and not finished: what the core's deltas add up to
        self._stopping = False
        self._replies: dict[str, concurrent.futures.Future] = {}  # adapter operations awaiting their LoraReply
        self._reader = threading.Thread(target=self._read, name="engine-core-reader", daemon=True)
        self._writer = threading.Thread(target=self._write, name="engine-core-writer", daemon=True)
        log.info("engine core process %d serving %s", self.pid, model_dir)

    def _wait_ready(self, timeout_s: float) -> CoreReady:
        deadline = time.monotonic() + timeout_s
        while not self._conn.poll(0.2):
            if not self._proc.is_alive():
                raise ModelLoadError(f"engine core process {_how_it_ended(self._proc.exitcode)} while loading")
            if time.monotonic() > deadline:
                self._proc.kill()
                raise ModelLoadError(f"engine core process not ready after {timeout_s:.0f} s")
        try:
            message = self._conn.recv()
        except (EOFError, OSError) as exc:
            raise ModelLoadError(f"engine core process exited while loading ({exc})") from exc
        if isinstance(message, CoreFailed):
            self._proc.join(_STOP_GRACE_S)
            raise ModelLoadError(message.error)
        return message

    # ----------------------------------------------------------------- lifecycle
    def start(self, loop) -> None:
        self._loop = loop
        self._reader.start()
        self._writer.start()

    def stop(self) -> None:
        self._stopping = True
        self._outbox.put(Shutdown())
        self._outbox.put(None)
        self._proc.join(_STOP_GRACE_S)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(_STOP_GRACE_S)
        self._conn.close()

    @property
    def alive(self) -> bool:
        return self.error is None and self._proc.is_alive()

    # ----------------------------------------------------------------- requests (event-loop side)
    def _send_add(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                  lora: str | None = None) -> None:
        prompt = list(prompt_token_ids)  # the handler's list stays the handler's
        params = validate_request(prompt, params, self.limits)
        if len(self._unstarted) >= self.limits.max_queue:
            raise QueueFullError(f"queue is full ({self.limits.max_queue} requests waiting); retry later",
                                 retry_after=1.0)
        self._unstarted.add(request_id)
        message = AddRequest(request_id, prompt, params, time.monotonic(), lora)
        self._assembler.add(request_id, prompt, params, message.arrival_time)
        self._outbox.put(message)

    def _send_abort(self, request_id: str) -> None:
        self._unstarted.discard(request_id)
        self._outbox.put(AbortRequest(request_id))

    async def load_lora(self, name: str, path: str) -> list[AdapterInfo]:
        return await self._control(LoadLora(uuid.uuid4().hex, name, path))

    async def unload_lora(self, name: str) -> list[AdapterInfo]:
        return await self._control(UnloadLora(uuid.uuid4().hex, name))

    async def _control(self, message: LoadLora | UnloadLora) -> list[AdapterInfo]:
        """Send an adapter operation to the core and wait for its ``LoraReply``."""
        if not self.alive:
            raise EngineDeadError(f"engine is not running: {self.error}")
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._replies[message.token] = future
        self._outbox.put(message)
        try:
            reply: LoraReply = await asyncio.wrap_future(future)
        finally:
            self._replies.pop(message.token, None)
        self.adapters = {a.name: a for a in reply.adapters}
        if reply.error is not None:
            raise reply.error
        return reply.adapters

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for o in outputs:
            self._unstarted.discard(o.request_id)
        super()._deliver(outputs)

    def _fail_one(self, request_id: str, err: BaseException) -> None:
        self._unstarted.discard(request_id)
        super()._fail_one(request_id, err)

    def _fail_all(self, err: BaseException) -> None:
        self._unstarted.clear()
        super()._fail_all(err)

    # ----------------------------------------------------------------- pipe threads
    def _write(self) -> None:
        while True:
            first = self._outbox.get()
            if first is None:
                return
            batch = [first]
            while True:  # what piled up during the last write goes in one message
                try:
                    more = self._outbox.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    self._outbox.put(None)
                    break
                batch.append(more)
            try:
                self._conn.send(batch)
            except (OSError, ValueError):
                return  # the core is gone; the reader reports it

    def _read(self) -> None:
        reason = "the engine core process closed its pipe"
        device_error = False
        while True:
            try:
                message = self._conn.recv()
            except (EOFError, OSError):
                break
            if isinstance(message, CoreStep):
                self.last_stats = message.stats
                outputs = [o for o in map(self._assembler.assemble, message.deltas) if o is not None]
                if self.metrics is not None:
                    self.metrics.observe(outputs)
                self._call_soon(self._deliver, outputs)
            elif isinstance(message, LoraReply):
                future = self._replies.get(message.token)
                if future is not None and not future.done():
                    future.set_result(message)
            elif isinstance(message, RequestRejected):
                self._assembler.discard(message.request_id)
                self._call_soon(self._fail_one, message.request_id, message.error)
            elif isinstance(message, CoreFailed):
                reason = f"the engine core failed: {message.error}"
                device_error = message.device_error
                break
        if self._stopping:
            return
        self._proc.join(1.0)
        reason += f" (process {self.pid} {_how_it_ended(self._proc.exitcode)})"
        if device_error:  # the server exits once in-flight requests have their 503 (server.DrainingServer)
            log.error("engine stopped: %s; answering 503 to what is in flight, then exiting", reason)
        else:
            log.error("engine stopped: %s; answering 503 until the server is restarted", reason)
        self._died(EngineDeadError(reason), fatal=device_error)


def _how_it_ended(exitcode: int | None) -> str:
    if exitcode is None:
        return "still running"
    if exitcode < 0:
        try:
            return f"killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"killed by signal {-exitcode}"
    return f"exited with code {exitcode}"
