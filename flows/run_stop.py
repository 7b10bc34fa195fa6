"""How `lifecycle run` stops on SIGTERM or SIGINT: within seconds, with one line that says how to resume.

The first signal raises `StopRequested` in the main thread (flows.stop_signals), so the run unwinds as after a
Ctrl-C: the stage's training stops, its MLflow run ends as failed, Prefect marks the task and flow run crashed
and, at exit, stops its ephemeral server. Nothing is lost: finished stages stay cached and a training stage
resumes from its last checkpoint, so the same command picks the run up again; the line says so.

Prefect's logging is switched off at the signal: its crash lines repeat what the one line says. And a signal
sent to the whole process group (Ctrl-C in a terminal, a supervisor stopping the group) has already stopped
the ephemeral server too; Prefect's clients then retry it for minutes, a traceback per failure (issue 31: two
minutes, two tracebacks). So a watchdog bounds the wait: as soon as Prefect's API refuses connections, at
`GRACE_SECONDS` after the signal at the latest, or at a second signal, it stops every process this one started
and exits at once.
"""

from __future__ import annotations

import gc
import logging
import os
import shlex
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from flows.stop_signals import StopRequested, StopSignals

__all__ = ["GRACE_SECONDS", "RunStop", "StopRequested", "resume_command"]

GRACE_SECONDS = 10.0  # a clean unwind takes one or two; only a dead Prefect server makes it wait longer
CHILD_GRACE_SECONDS = 3.0


def silence_prefect() -> None:
    """Drop every record of Prefect's loggers from now on (its crash reports and its clients' retries)."""
    for name in list(logging.Logger.manager.loggerDict):
        if name == "prefect" or name.startswith("prefect."):
            logging.getLogger(name).disabled = True


def running_stage() -> str | None:
    """The stage whose task runs in this thread (the signal handler runs inside it), else None."""
    try:
        from prefect.context import TaskRunContext
    except ImportError:
        return None
    context = TaskRunContext.get()
    return context.task_run.name if context is not None else None


def prefect_api_address() -> tuple[str, int] | None:
    """Host and port of the Prefect API the flow run in this thread reports to, else None."""
    try:
        from prefect.context import FlowRunContext
    except ImportError:
        return None
    context = FlowRunContext.get()
    if context is None or context.client is None:
        return None
    url = urlsplit(str(context.client.api_url))
    return (url.hostname, url.port) if url.hostname and url.port else None


def refuses_connections(host: str, port: int) -> bool:
    """Whether nothing listens at host:port any more (a slow answer is not a refusal)."""
    try:
        socket.create_connection((host, port), timeout=1.0).close()
    except ConnectionRefusedError:
        return True
    except OSError:
        return False
    return False


def stop_descendants(grace: float = CHILD_GRACE_SECONDS) -> None:
    """SIGTERM every process this one started, directly or not (Prefect's ephemeral server, a stage's training
    workers), and SIGKILL those still running after `grace` seconds."""
    import psutil

    children = psutil.Process().children(recursive=True)
    for child in children:
        try:
            child.terminate()
        except psutil.NoSuchProcess:
            continue
    _, alive = psutil.wait_procs(children, timeout=grace)
    for child in alive:
        try:
            child.kill()
        except psutil.NoSuchProcess:
            continue


@dataclass
class RunStop:
    """Entered around a `lifecycle run`; `announce` prints the one line, at most once, from either way out."""

    resume_command: str
    grace: float = GRACE_SECONDS
    stage: str | None = None
    _announced: bool = False
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _signals: StopSignals = field(init=False)

    def __post_init__(self) -> None:
        self._signals = StopSignals(on_first=self._begin, on_repeat=self._exit_now)

    def __enter__(self) -> RunStop:
        self._signals.__enter__()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._signals.__exit__(*exc_info)

    def line(self, signum: int) -> str:
        where = f" during stage {self.stage}" if self.stage else ""
        return f"stopped by {signal.Signals(signum).name}{where}; resume with: {self.resume_command}"

    def announce(self, signum: int) -> None:
        with self._lock:
            if self._announced:
                return
            self._announced = True
        # a progress bar being drawn leaves the cursor at the end of its line: the one line goes under it
        print(("\n" if _a_bar_is_drawn() else "") + self.line(signum), file=sys.stderr, flush=True)

    def finish(self, request: StopRequested) -> int:
        """The way out of a run the signal unwound: the line, and the exit status for the signal.

        Every object alive now is frozen: the interpreter's last garbage collection would otherwise walk all that
        torch and transformers built (8 s on a loaded 2-core host) before the process could exit."""
        self.announce(request.signum)
        gc.freeze()
        return request.exit_status

    def _begin(self, signum: int) -> None:
        """The first signal, in the main thread, before `StopRequested` is raised there."""
        silence_prefect()
        self.stage = running_stage()
        # a daemon: it still watches while the interpreter runs its exit handlers
        threading.Thread(target=self._watch, args=(signum, prefect_api_address()), daemon=True).start()

    def _watch(self, signum: int, api: tuple[str, int] | None) -> None:
        """Exit at the deadline, or as soon as Prefect's API refuses connections: then nothing Prefect still
        tries to report can arrive (the ephemeral server got the signal too, or was stopped at exit)."""
        deadline = time.monotonic() + self.grace
        while time.monotonic() < deadline and not (api is not None and refuses_connections(*api)):
            time.sleep(0.2)
        self._exit_now(signum)

    def _exit_now(self, signum: int) -> None:
        """The unwind took too long, or a second signal came: say the line, stop the children, exit."""
        self.announce(signum)
        stop_descendants()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(128 + signum)


def resume_command(recipe: str, json_out: str | None = None) -> str:
    """The command that resumes the run: the same one (finished stages come from cache)."""
    words = ["lifecycle", "run", recipe] + (["--json-out", json_out] if json_out else [])
    return shlex.join(words)


def _a_bar_is_drawn() -> bool:
    """Whether a tqdm bar is open in this process (its last draw ended without a newline)."""
    tqdm = sys.modules.get("tqdm")
    instances = getattr(getattr(tqdm, "tqdm", None), "_instances", None)
    return bool(instances)
