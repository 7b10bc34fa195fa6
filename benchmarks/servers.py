"""The server processes a benchmark starts on 127.0.0.1, and how a benchmark that starts them ends.

Each server runs in its own session (Ctrl-C in the terminal does not reach it) with its output in a log file;
`run_with_servers` gives a benchmark's body a list to put them in and stops every one of them on the way out,
also on Ctrl-C, so no run leaves servers behind.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path

from artifacts.common.cli import exit_status
from artifacts.common.net import free_port, wait_until_ready
from artifacts.errors import LifecycleError

REPO = Path(__file__).resolve().parent.parent
SERVED_NAME = "bench"

__all__ = ["REPO", "SERVED_NAME", "BenchError", "Child", "OneLineParser", "add_key", "bench_parser", "build_model",
           "check_model_dir", "engine_server", "free_port", "launch", "machine_facts", "run_with_servers", "serve_args",
           "start_gateway", "stop_all", "wait_ready"]


class BenchError(LifecycleError):
    """Something the user can fix or a server that did not come up: one line, exit 2."""


class OneLineParser(argparse.ArgumentParser):
    """A bad flag is one line and exit 2, as with the project's own commands (no usage block)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message}\n")


def bench_parser(prog: str, doc: str) -> OneLineParser:
    """A serving benchmark's parser: the first paragraph of its ``doc`` as the description, defaults shown, and
    ``--model`` (checked by ``check_model_dir``)."""
    ap = OneLineParser(prog=prog, description=doc.split("\n\n")[0],
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--model", type=Path, default=None,
                    help="HF model dir to serve (default: build the serving-bench model, benchmarks/bench_model.py)")
    return ap


def check_model_dir(ap: argparse.ArgumentParser, model: Path | None) -> None:
    """``--model``, when given, must be a Hugging Face model dir."""
    if model is not None and not (model / "config.json").is_file():
        ap.error(f"--model: {model} is not a Hugging Face model dir (no config.json)")


class Child:
    """A server process in its own session (Ctrl-C in the terminal does not reach it), its output in a log."""

    def __init__(self, name: str, args: list[str], log: Path, env: dict[str, str] | None,
                 cwd: Path | None = None) -> None:
        self.name, self.log = name, log
        self._handle = open(log, "ab")  # noqa: SIM115 - closed in stop()
        try:
            self.proc = subprocess.Popen(args, stdout=self._handle, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, cwd=cwd or REPO, env=env, start_new_session=True)
        except OSError as exc:  # a peer's python that is not there (--vllm-python, $VLLM_PYTHON): one line
            self._handle.close()
            raise BenchError(f"{name}: cannot start {args[0]} ({exc.strerror})") from None

    @property
    def pid(self) -> int:
        return self.proc.pid

    def tail(self, n: int = 15) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def terminate(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass

    def stop(self) -> None:
        """After ``terminate``: wait, then SIGKILL what is left of its process group."""
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(timeout=15)
        self._handle.close()


def wait_ready(child: Child, url: str, timeout_s: float, path: str = "/ready") -> None:
    """Poll `path` until 200 (ours answers `/ready`; vLLM's OpenAI server only has `/health`)."""
    if wait_until_ready(url + path, timeout_s, alive=lambda: child.proc.poll() is None) is None:
        return
    if child.proc.poll() is not None:
        raise BenchError(f"{child.name} exited with {child.proc.returncode} while starting; "
                         f"log {child.log}:\n{child.tail()}")
    raise BenchError(f"{child.name} not ready at {url} after {timeout_s:.0f} s; log {child.log}")


def launch(children: list[Child], name: str, args: list[str], log: Path, env: dict[str, str] | None, url: str,
           timeout_s: float, path: str = "/ready", cwd: Path | None = None) -> Child:
    """Start a server into ``children`` first (so it is stopped whatever happens next), then wait until it is
    ready (see `wait_ready`); returns it. ``cwd`` (default: this repository) is where ``python -m`` finds the
    code, so another checkout there serves its own version."""
    child = Child(name, args, log, env, cwd)
    children.append(child)
    wait_ready(child, url, timeout_s, path)
    return child


def stop_all(children: Iterable[Child]) -> None:
    """SIGTERM every server first (they shut down side by side), then wait for each."""
    children = list(children)
    for child in children:
        child.terminate()
    for child in children:
        child.stop()


def serve_args(model: Path, port: int, threads: int) -> list[str]:
    """The ``serving.cli`` arguments of an engine server as the benchmarks start it (quiet log, a 1 s drain)."""
    return ["serve", str(model), "--port", str(port), "--served-model-name", SERVED_NAME, "--threads", str(threads),
            "--log-level", "warning", "--drain-timeout", "1"]


def engine_server(name: str, model: Path, port: int, threads: int, logs: Path, env: dict[str, str]) -> Child:
    return Child(name, [sys.executable, "-m", "serving.cli", *serve_args(model, port, threads)],
                 logs / f"{name}.log", env)


def start_gateway(config: dict, logs: Path, env: dict[str, str], launcher: list[str] | None = None,
                  extra: tuple[str, ...] = ()) -> tuple[Child, str, str]:
    """A user key and an admin key (``bench``, ``bench-admin``) in ``logs/keys.json``, the gateway's config
    (``config`` and that keys file) in ``logs/gateway.yaml``, and the gateway started on it: ``python -m
    serving.gateway.cli``, or ``launcher`` followed by the config's path and ``extra``.

    Returns (the gateway's process, the user key, the admin key)."""
    keys_file = logs / "keys.json"
    user, admin = add_key(keys_file, "bench", env), add_key(keys_file, "bench-admin", env, admin=True)
    (logs / "gateway.yaml").write_text(json.dumps({**config, "keys_file": str(keys_file)}, indent=2))  # JSON is YAML
    launcher = launcher or [sys.executable, "-m", "serving.gateway.cli"]
    child = Child("gateway", [*launcher, str(logs / "gateway.yaml"), *extra], logs / "gateway.log", env)
    return child, user, admin


def add_key(keys_file: Path, name: str, env: dict[str, str], admin: bool = False) -> str:
    """A gateway key through the operator's CLI; returns the secret it prints once."""
    args = [sys.executable, "-m", "serving.gateway.cli", "gateway-keys", "add", name, "--keys-file", str(keys_file),
            "--rpm", "1000000", "--tpm", "1000000000"] + (["--admin"] if admin else [])
    p = subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    if p.returncode != 0:
        raise BenchError(f"gateway-keys add {name}: {(p.stderr or p.stdout).strip()[-300:]}")
    return p.stdout.strip().splitlines()[-1]


def build_model(env: dict[str, str]) -> Path:
    """The serving-bench model (built once, cached), in a child so torch's import chatter stays in its pipe."""
    from benchmarks.bench_model import DEFAULT_MODEL_DIR

    print(f"model: {DEFAULT_MODEL_DIR.relative_to(REPO)} (built first if missing)", flush=True)
    code = "from benchmarks.bench_model import build_bench_model; print(build_bench_model())"
    p = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True)
    if p.returncode != 0:
        raise BenchError(f"building the bench model failed: {(p.stderr or p.stdout).strip()[-500:]}")
    return Path(p.stdout.strip().splitlines()[-1])


def machine_facts() -> str:
    """CPU, its widest vector unit (hosts behind one name differ: the same `AMD EPYC` label has come with and
    without AVX-512), load and time: what a reader needs to compare two runs."""
    cpu, flags = "?", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and cpu == "?":
                cpu = line.split(":", 1)[1].strip()
            elif line.startswith("flags") and not flags:
                flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    isa = next((name for name in ("avx512f", "avx2") if name in flags), "")
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    return (f"{os.cpu_count()} CPUs (`{cpu}`{', ' + isa.upper() if isa else ''}), load average {load}, "
            f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")


def run_with_servers(log_prefix: str, keep_logs: bool, body: Callable[[list[Child], Path], None]) -> int:
    """A benchmark's run, as its exit status: ``body(children, logs)`` starts its servers into ``children`` (log
    files under ``logs``, a fresh temporary folder) and measures. A BenchError is one line and exit 2, Ctrl-C or
    SIGTERM exit 130; whatever happens, every server in ``children`` is stopped, and the logs of a run that went
    well are removed unless ``keep_logs`` (they are named in the error otherwise)."""
    children: list[Child] = []

    def on_term(signum, frame) -> None:  # noqa: ANN001
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)  # also when started with SIGINT ignored (a background job)
    logs = Path(tempfile.mkdtemp(prefix=log_prefix))
    ok = False

    def run() -> None:
        nonlocal ok
        body(children, logs)
        ok = True

    try:
        return exit_status(run, interrupted="interrupted; stopping the servers")
    finally:
        _stop_children(children, logs, remove_logs=ok and not keep_logs)


def _stop_children(children: list[Child], logs: Path, remove_logs: bool) -> None:
    """Stop every server a run started, deaf to a second Ctrl-C meanwhile (it must not leave servers behind),
    and drop the logs of a run that went well."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    stop_all(children)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if remove_logs:
        import shutil

        shutil.rmtree(logs, ignore_errors=True)
