"""The engine's step loop in a background thread of the server process (``lifecycle serve --no-engine-process``
and the tests): the ``EngineClient`` whose engine lives in this process."""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import TYPE_CHECKING

from serving.api.engine_client import EngineClient, EngineDeadError
from serving.api.metrics import ServerMetrics
from serving.engine import SamplingParams
from serving.engine.device_errors import describe_device_error, is_device_error
from serving.engine.lora_info import AdapterInfo

if TYPE_CHECKING:
    from serving.engine import LLMEngine

log = logging.getLogger(__name__)


class ThreadEngineClient(EngineClient):
    """The engine's step loop in a background thread of the server process."""

    def __init__(self, engine: LLMEngine, metrics: ServerMetrics | None = None) -> None:
        super().__init__(metrics)
        self.engine = engine
        self._wake = threading.Event()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="engine-step-loop", daemon=True)

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

    def _send_add(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                  lora: str | None = None) -> None:
        self.engine.add_request(request_id, prompt_token_ids, params, lora=lora)
        self._wake.set()

    async def load_lora(self, name: str, path: str) -> list[AdapterInfo]:
        await asyncio.to_thread(self.engine.load_lora, name, path)  # the read runs off the event loop
        return self._adapters_now()

    async def unload_lora(self, name: str) -> list[AdapterInfo]:
        self.engine.unload_lora(name)
        return self._adapters_now()

    def _adapters_now(self) -> list[AdapterInfo]:
        infos = [a.info for a in self.engine.loras.values()]
        self.adapters = {a.name: a for a in infos}
        return infos

    def _send_abort(self, request_id: str) -> None:
        self.engine.abort(request_id)
        self._wake.set()

    def _engine_busy(self) -> bool:
        return self.engine.has_unfinished()

    # ----------------------------------------------------------------- engine thread
    def _run(self) -> None:
        while not self._stop:
            if not self.engine.has_unfinished():
                self._wake.wait(0.05)
                self._wake.clear()
                continue
            try:
                outputs = self.engine.step()
            except Exception as e:  # a bug or device failure: fail loudly, never hang clients
                if is_device_error(e):
                    log.critical("engine step failed: %s", describe_device_error(e))
                    self._died(EngineDeadError(describe_device_error(e)), fatal=True)
                    return
                log.exception("engine step failed")
                self._died(EngineDeadError(str(e)))
                return
            if not outputs:
                continue
            if self.metrics is not None:
                self.metrics.observe(outputs)
            self._call_soon(self._deliver, outputs)
