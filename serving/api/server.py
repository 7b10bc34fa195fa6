"""The server process: load (and verify) the engine, serve the app with uvicorn, drain on SIGTERM.

The app itself (routes, handlers, OpenAPI) is ``serving.api.app``.
"""

from __future__ import annotations

import copy
import logging
import logging.config
import signal
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

import uvicorn
from uvicorn.config import LOGGING_CONFIG

from serving.api.app import build_app
from serving.api.engine_view import EngineView
from serving.api.process_engine_client import ProcessEngineClient
from serving.api.server_state import ServerState
from serving.engine import EngineConfig
from serving.engine.device_errors import DeviceFailedError
from serving.engine.generation_defaults import SamplingDefaults

if TYPE_CHECKING:
    from serving.engine import LLMEngine

log = logging.getLogger(__name__)

# After the drain timeout the server ends what is still in flight; this is how long the handlers then
# get to write their last event before uvicorn cancels them (a client that stopped reading).
_FINAL_WRITE_S = 5.0
# How long an idle keep-alive connection stays open: longer than the gateway keeps an idle upstream connection in
# its pool (60 s), so the gateway drops a connection before the replica closes it. With uvicorn's default (5 s) a
# replica that got no request or health poll for 5 s closed the connection the gateway would reuse next: a reconnect,
# or, in the race, a failed request counted against that replica's variant (benchmarks/NOTEBOOK.md, "Gateway: what
# a low-share variant pays").
KEEP_ALIVE_S = 75.0


def verify_if_bundle(path: Path) -> None:
    """Verify a bundle (a directory with manifest.json) in full; one that fails raises
    BundleVerificationError and is never served. Plain HF model directories pass as they are."""
    if (path / "manifest.json").is_file():
        from artifacts.verify import verify_bundle  # lazy: serving plain dirs needs no artifacts stack

        verify_bundle(path)


def load_engine(model_dir: str | Path, engine_config: EngineConfig | None = None,
                verify: bool = True) -> LLMEngine:
    """Verify (a bundle), then load the engine into this process."""
    from serving.engine import LLMEngine  # torch: only where the engine steps in this process

    path = Path(model_dir)
    if verify:
        verify_if_bundle(path)
    return LLMEngine.from_pretrained(path, engine_config or EngineConfig())


def _log_sampling_defaults(path: Path, defaults: SamplingDefaults) -> None:
    if defaults.given():
        log.info("sampling defaults from %s/generation_config.json for fields a request leaves out: %s", path,
                 defaults.given())


def logging_config(log_level: str) -> dict[str, Any]:
    """uvicorn's logging, with the ``serving`` loggers on the same handler and level (one log stream)."""
    config = copy.deepcopy(LOGGING_CONFIG)
    config["loggers"]["serving"] = {"handlers": ["default"], "level": log_level.upper(), "propagate": False}
    return config


def run_server(model_dir: str | Path, host: str = "127.0.0.1", port: int = 8000,
               engine_config: EngineConfig | None = None, served_model_name: str | None = None,
               drain_timeout_s: float = 30.0, log_level: str = "info", verify: bool = True,
               engine_process: bool = True, lora_modules: dict[str, str] | None = None,
               admin_key: str | None = None) -> None:
    """Load, verify, warm up and serve until SIGTERM/SIGINT; SIGTERM drains in-flight requests first. A device
    error in the engine ends the server too, with DeviceFailedError (exit status 2 from the CLI), once the
    requests in flight have their 503: a fresh process is the only cure for a poisoned CUDA context.

    With ``engine_process`` the engine steps in its own process (``serving.engine.core_process``) and this
    one only speaks HTTP; without it, in a thread of this process. /ready answers 200 only once loading,
    verification and the warm-up generation are done.
    """
    log_config = logging_config(log_level)
    logging.config.dictConfig(log_config)
    path = Path(model_dir)
    config = engine_config or EngineConfig()
    name = served_model_name or path.name
    if engine_process:
        if verify:
            verify_if_bundle(path)
        client = ProcessEngineClient(path, config, log_level)
        engine = EngineView.load(path, client)
        app = build_app(engine, name, client=client, admin_key=admin_key, lora_modules=lora_modules,
                        model_dir=str(path))
    else:
        engine = load_engine(path, config, verify=verify)
        app = build_app(engine, name, admin_key=admin_key, lora_modules=lora_modules, model_dir=str(path))
    _log_sampling_defaults(path, engine.sampling_defaults)
    uv_config = uvicorn.Config(app, host=host, port=port, log_level=log_level, log_config=log_config,
                               access_log=False, timeout_graceful_shutdown=_FINAL_WRITE_S,
                               timeout_keep_alive=KEEP_ALIVE_S)
    DrainingServer(uv_config, app.state.serving, drain_timeout_s).run()
    client = app.state.serving.engine_client
    if client.fatal:
        raise DeviceFailedError(f"{client.error}; the server exits so that the replica is replaced")


class DrainingServer(uvicorn.Server):
    """uvicorn server whose SIGTERM drains first: 503 for new requests, in-flight ones run to their end for
    up to ``drain_timeout_s``; then those still running are ended (a 503, or an error event then [DONE]
    in a stream) and the process exits. uvicorn alone would wait for open streams without limit, and an
    orchestrator's grace period would end in SIGKILL and cut every stream mid-event."""

    def __init__(self, config: uvicorn.Config, state: ServerState, drain_timeout_s: float = 30.0) -> None:
        super().__init__(config)
        self._state = state
        self._drain_timeout_s = drain_timeout_s
        self._draining_started = False
        state.engine_client.on_fatal = self._exit_after_device_error

    def _exit_after_device_error(self) -> None:
        """On the event loop, after the in-flight requests were failed: stop serving (run_server raises)."""
        log.error("the engine's device failed; exiting so that the replica is replaced")
        self.should_exit = True

    def handle_exit(self, sig: int, frame: Any) -> None:
        if sig != signal.SIGTERM or self._draining_started:
            return super().handle_exit(sig, frame)
        self._draining_started = True
        engine = self._state.engine_client
        engine.draining = True
        log.info("SIGTERM: draining %d in-flight request(s), for at most %.1fs", engine.num_in_flight(),
                 self._drain_timeout_s)

        def finish() -> None:
            if not engine.wait_idle(self._drain_timeout_s):
                log.warning("drain timeout (%.1fs) reached: ending %d request(s) still in flight with a 503",
                            self._drain_timeout_s, engine.num_in_flight())
                engine.abort_all_threadsafe(f"server shutting down: the drain timeout ({self._drain_timeout_s:g}s) "
                                            "ended this request before it finished")
                engine.wait_idle(_FINAL_WRITE_S)
            self.should_exit = True

        threading.Thread(target=finish, name="drain", daemon=True).start()
