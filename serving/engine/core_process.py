"""The engine core in its own process: the step loop, with nothing else competing for its interpreter.

In one process the HTTP side (parsing JSON, building SSE chunks, the event loop) and the step loop share
one GIL, so every chunk written is time the model is not stepping. Here, as in vLLM v1, the API process
tokenizes, validates and writes the answers, and this process only schedules, runs the model and
detokenizes (stop strings end a sequence here, where its blocks are freed). The two talk over a pipe:
the API sends lists of ``AddRequest`` / ``AbortRequest`` / ``Shutdown``; this side answers once with ``CoreReady``
(or ``CoreFailed``) and then sends one ``CoreStep`` per step that produced outputs, each output as what the step
added to its request (``serving.engine.output_deltas``), which the API side assembles into ``RequestOutput``s.

The core never waits for the API side: it drains whatever arrived before each step and sends the step's
outputs in one message, which the API's reader thread takes off the pipe at once. When the API process
goes away (the pipe closes) the core exits; signals are left to the API process, which decides when the
core stops (a drain ends with ``Shutdown``). A device error (``serving.engine.device_errors``) is reported as a
``CoreFailed`` with ``device_error`` set, and the core exits with ``DEVICE_ERROR_EXIT`` at once, without the
interpreter's teardown, which would touch the poisoned CUDA context again.
"""

from __future__ import annotations

import logging
import signal
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path

from artifacts.common.fast_exit import exit_now
from serving.engine.config import EngineConfig
from serving.engine.device_errors import DEVICE_ERROR_EXIT, describe_device_error, is_device_error
from serving.engine.errors import EngineError
from serving.engine.limits import RequestLimits
from serving.engine.lora_info import AdapterInfo
from serving.engine.output_deltas import DeltaEncoder, RequestDelta
from serving.engine.outputs import EngineStats
from serving.engine.sampling_params import SamplingParams

log = logging.getLogger(__name__)

# how long an idle core blocks on the pipe before looking again (it wakes at once when a message comes)
_IDLE_POLL_S = 0.5


# ----------------------------------------------------------------------------- API -> core
@dataclass
class AddRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams  # validated, with max_tokens resolved, by the API side
    arrival_time: float  # time.monotonic() in the API process (one clock for both processes on Linux)
    lora: str | None = None  # the adapter it runs on (None: the base)


@dataclass
class LoadLora:
    """Read a LoRA adapter and make it servable; answered by a ``LoraReply`` with the same ``token``."""

    token: str
    name: str
    path: str


@dataclass
class UnloadLora:
    token: str
    name: str


@dataclass
class AbortRequest:
    request_id: str


@dataclass
class Shutdown:
    pass


# ----------------------------------------------------------------------------- core -> API
@dataclass
class CoreReady:
    """``tokenizer_class``: ``module:qualname`` of the class ``AutoTokenizer`` chose here (None: no tokenizer),
    so that the API process loads the same one without importing torch (``serving.api.engine_view``)."""

    pid: int
    limits: RequestLimits
    stats: EngineStats
    tokenizer_class: str | None = None


@dataclass
class CoreFailed:
    """The core could not start, or its step loop broke: ``error`` is one line for the operator.
    ``device_error``: the device failed, and the server should exit so the replica is replaced."""

    error: str
    device_error: bool = False


@dataclass
class CoreStep:
    deltas: list[RequestDelta]
    stats: EngineStats


@dataclass
class LoraReply:
    """What a ``LoadLora`` or ``UnloadLora`` did: ``error`` None on success; ``adapters``: every loaded adapter
    afterwards."""

    token: str
    error: EngineError | None
    adapters: list[AdapterInfo]


@dataclass
class RequestRejected:
    """The engine refused a request the API side let through (its queue filled in the meantime)."""

    request_id: str
    error: EngineError


def run_engine_core(model_dir: str, config: EngineConfig, conn: Connection, log_level: str = "WARNING") -> None:
    """Entry point of the engine-core process (spawned by ``serving.api.process_engine_client``)."""
    import os

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group: the API decides
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=log_level.upper(), format="%(levelname)s:     engine core: %(message)s")
    from artifacts.common.quiet import quiet_warnings
    quiet_warnings()
    from serving.engine.engine import LLMEngine

    try:
        engine = LLMEngine.from_pretrained(Path(model_dir), config)
    except Exception as exc:  # noqa: BLE001 - reported to the API process as one line, which exits with it
        conn.send(CoreFailed(str(exc) if isinstance(exc, EngineError) else f"{type(exc).__name__}: {exc}"))
        return
    tokenizer = type(engine.tokenizer) if engine.tokenizer is not None else None
    tokenizer_class = f"{tokenizer.__module__}:{tokenizer.__qualname__}" if tokenizer else None
    conn.send(CoreReady(os.getpid(), engine.limits, engine.stats(), tokenizer_class))
    try:
        _step_loop(engine, conn)
    except (EOFError, OSError):
        pass  # the API process is gone: nobody to serve
    except Exception as exc:  # noqa: BLE001 - a broken loop is reported, then the process ends
        if is_device_error(exc):
            _exit_on_device_error(conn, exc)
        log.exception("engine core failed")
        try:
            conn.send(CoreFailed(f"{type(exc).__name__}: {exc}"))
        except OSError:
            pass
    # the pipe's last message is sent, and the API process waits for this one to end before it can exit
    exit_now(0)


def _exit_on_device_error(conn: Connection, exc: BaseException) -> None:
    """Report a device error in one line, then leave with ``DEVICE_ERROR_EXIT``: ``os._exit`` skips the
    teardown (freeing tensors, CUDA's own exit handlers), which could hang or fail again on the poisoned
    context. The pipe's message is already written when ``send`` returns."""
    import os

    line = describe_device_error(exc)
    log.critical("%s; exiting with status %d so the replica is replaced", line, DEVICE_ERROR_EXIT)
    try:
        conn.send(CoreFailed(line, device_error=True))
    except OSError:
        pass
    logging.shutdown()
    os._exit(DEVICE_ERROR_EXIT)


def _step_loop(engine, conn: Connection) -> None:
    encoder = DeltaEncoder()
    while True:
        busy = engine.has_unfinished()
        if conn.poll(0 if busy else _IDLE_POLL_S):
            while True:
                batch = conn.recv()  # a list: the API's writer sends what piled up in one message
                for message in batch:
                    if isinstance(message, Shutdown):
                        return
                    _apply(engine, conn, message)
                if not conn.poll(0):
                    break
            busy = engine.has_unfinished()
        if not busy:
            continue
        outputs = engine.step()
        if outputs:
            conn.send(CoreStep([encoder.encode(o) for o in outputs], engine.stats()))


def _apply(engine, conn: Connection, message: AddRequest | AbortRequest | LoadLora | UnloadLora) -> None:
    if isinstance(message, AbortRequest):
        engine.abort(message.request_id)
        return
    if isinstance(message, (LoadLora, UnloadLora)):
        # reading an adapter holds the step loop for the read (milliseconds for a rank-16 adapter of a small
        # model); the requests in flight wait that long, none fails
        try:
            if isinstance(message, LoadLora):
                engine.load_lora(message.name, message.path)
            else:
                engine.unload_lora(message.name)
            error = None
        except EngineError as exc:
            error = exc
        conn.send(LoraReply(message.token, error, [a.info for a in engine.loras.values()]))
        return
    try:
        engine.add_request(message.request_id, message.prompt_token_ids, message.params,
                           arrival_time=message.arrival_time, lora=message.lora)
    except EngineError as exc:
        conn.send(RequestRejected(message.request_id, exc))
