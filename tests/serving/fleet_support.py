"""Real servers on 127.0.0.1 for the gateway and rollout tests: engine replicas and gateways, in threads or
in their own processes (the kill -9 tests need processes). Not a test module."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import uvicorn

from artifacts.common.net import free_port, wait_until_ready

REPO = Path(__file__).resolve().parents[2]
DEPLOY = [sys.executable, "-m", "serving.deploy"]


def deploy(*args: str, home: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    """The `deploy` command line as a user runs it, with its own workdir (``LIFECYCLE_HOME``)."""
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"} | {"LIFECYCLE_HOME": str(home)}
    return subprocess.run([*DEPLOY, *args], capture_output=True, text=True, timeout=timeout, cwd=REPO, env=env)


def wait_ready(url: str, timeout: float = 180.0, path: str = "/ready") -> None:
    if wait_until_ready(url + path, timeout, interval=0.05) is not None:
        raise AssertionError(f"{url}{path} never became ready")


@contextlib.contextmanager
def uvicorn_thread(app, port: int | None = None) -> Iterator[str]:
    """Serve an ASGI app on 127.0.0.1 in a thread; yields its base URL once it answers."""
    port = port or free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                           timeout_graceful_shutdown=3))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{port}"
    try:
        wait_ready(base, path="/health")
        yield base
    finally:
        server.should_exit = True
        thread.join(timeout=20)


@contextlib.contextmanager
def engine_thread(model_dir: Path, name: str, lora_modules: dict[str, str] | None = None) -> Iterator[str]:
    """One of our engine servers on a model dir, in a thread (fast to start; shares this process); with
    ``lora_modules`` (served name -> adapter directory), serving those adapters beside the base."""
    from serving.api import build_app
    from serving.engine import EngineConfig, LLMEngine

    config = EngineConfig(num_blocks=512, block_size=8, max_num_seqs=32, max_loras=len(lora_modules or {}))
    engine = LLMEngine.from_pretrained(model_dir, config)
    app = build_app(engine, name, lora_modules=lora_modules, model_dir=str(model_dir) if lora_modules else None)
    with uvicorn_thread(app) as base:
        wait_ready(base)
        yield base


class Process:
    """A child process with its log in a file; ``kill9`` is what a crash looks like."""

    def __init__(self, args: list[str], log: Path, env: dict[str, str] | None = None) -> None:
        self.args, self.log = args, log
        self.handle = open(log, "ab")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(args, stdout=self.handle, stderr=subprocess.STDOUT, cwd=REPO,
                                     env=os.environ | (env or {}), start_new_session=True)

    def kill9(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.kill9()
        self.handle.close()

    def tail(self, n: int = 40) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])


def engine_process(model_dir: Path, port: int, log: Path, name: str) -> Process:
    return Process([sys.executable, "-m", "serving.cli", "serve", str(model_dir), "--port", str(port),
                    "--served-model-name", name, "--num-blocks", "512", "--block-size", "8", "--threads", "1",
                    "--log-level", "warning"], log)


def gateway_process(config_path: Path, log: Path) -> Process:
    return Process([sys.executable, "-m", "serving.gateway.cli", str(config_path)], log)


def make_keys(path: Path, **user_limits) -> tuple[str, str]:
    """A keys file with one user key and one admin key; returns their secrets."""
    from serving.gateway.keys import KeyStore

    store = KeyStore([])
    user = store.add("user", requests_per_minute=user_limits.get("rpm"), tokens_per_minute=user_limits.get("tpm"))
    admin = store.add("ops", admin=True, requests_per_minute=1e6, tokens_per_minute=1e9)
    store.save(path)
    return user, admin


def bearer(secret: str) -> dict[str, str]:
    return {"authorization": f"Bearer {secret}"}
