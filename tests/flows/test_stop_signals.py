"""`lifecycle run` and `lifecycle ui` stopped by a signal: out within seconds, one line, nothing left running.

Issue 31: a SIGTERM during SFT took two minutes and printed two tracebacks (Prefect's clients retrying the
ephemeral server the signal had stopped too), and a stopped `lifecycle ui` left `mlflow ui` and its uvicorn
workers on the port.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
import yaml

from artifacts.common.net import free_port, wait_until_ready
from flows.stop_signals import StopRequested, StopSignals

LIFECYCLE = [sys.executable, "-m", "flows.cli"]
STOP_WITHIN_S = 20


def cli_env(home: Path) -> dict[str, str]:
    """This environment minus the stores other tests may point at; the workdir is `home`."""
    own = ("MLFLOW_TRACKING_URI", "PREFECT_API_URL", "PREFECT_HOME", "LIFECYCLE_HOME")
    return {k: v for k, v in os.environ.items() if k not in own} | {"LIFECYCLE_HOME": str(home)}


@contextlib.contextmanager
def started(command: list[str], home: Path, stderr: Path) -> Iterator[subprocess.Popen]:
    """`command` in a session of its own (the test can signal it and all it started at once); whatever of that
    session is left at the end is killed, so a failed test leaves nothing running."""
    with open(stderr, "w") as err:
        proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=err, env=cli_env(home),
                                start_new_session=True)
    descendants: list[psutil.Process] = []
    try:
        yield proc
    finally:
        with contextlib.suppress(psutil.Error):
            descendants = psutil.Process(proc.pid).children(recursive=True)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        for child in descendants:  # those in sessions of their own too
            with contextlib.suppress(psutil.Error):
                child.kill()
        proc.wait()


def wait_for_text(path: Path, text: str, proc: subprocess.Popen, timeout: float = 900) -> str:
    deadline = time.monotonic() + timeout
    while text not in path.read_text(errors="replace"):
        assert proc.poll() is None, f"exited with {proc.returncode} before {text!r}:\n{path.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"no {text!r} within {timeout:.0f} s"
        time.sleep(0.2)
    return path.read_text(errors="replace")


def stop_and_time(proc: subprocess.Popen, whole_group: bool) -> float:
    """Seconds from SIGTERM to exit."""
    started_at = time.monotonic()
    if whole_group:  # what a terminal's Ctrl-C or a supervisor does: Prefect's ephemeral server gets it too
        os.killpg(proc.pid, signal.SIGTERM)
    else:
        proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=120)
    return time.monotonic() - started_at


def group_alive(pgid: int) -> list[str]:
    """The command lines of the live (not zombie) processes of process group `pgid`."""
    found = []
    for proc in psutil.process_iter(["status", "cmdline"]):
        try:
            if proc.info["status"] != psutil.STATUS_ZOMBIE and os.getpgid(proc.pid) == pgid:
                found.append(" ".join(proc.info["cmdline"] or [])[:120])
        except (ProcessLookupError, psutil.Error):
            continue
    return found


def assert_stopped_cleanly(proc: subprocess.Popen, seconds: float, stderr: Path, recipe: Path) -> None:
    text = stderr.read_text(errors="replace")
    resume = f"resume with: {shlex.join(['lifecycle', 'run', str(recipe)])}"
    assert seconds < STOP_WITHIN_S, f"took {seconds:.1f} s to stop:\n{text[-3000:]}"
    assert proc.returncode == 128 + signal.SIGTERM, text[-3000:]
    lines = [line for line in text.replace("\r", "\n").splitlines() if "resume with" in line]
    assert lines == [f"stopped by SIGTERM during stage sft; {resume}"], text[-3000:]
    assert "Traceback" not in text, text[-5000:]


def test_a_stop_signal_unwinds_as_one_exception_with_the_signals_exit_status() -> None:
    previous = signal.getsignal(signal.SIGTERM)
    seen: list[int] = []
    with pytest.raises(StopRequested) as caught, StopSignals(on_first=seen.append):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)  # the handler raises at the next bytecode; never reached
    assert caught.value.exit_status == 143 and caught.value.signal_name == "SIGTERM" and seen == [signal.SIGTERM]
    assert signal.getsignal(signal.SIGTERM) is previous


@pytest.mark.slow
def _with_a_long_sft(recipe_path: Path) -> Path:
    """The smoke recipe with an SFT stage far longer than the test's wait (3 steps finish in ~2 s on a quiet host,
    and the signal then found the next stage running, or the resumed run never ran SFT at all: CI, session 45)."""
    recipe = yaml.safe_load(recipe_path.read_text())
    recipe["training"]["sft"].update(max_steps=2000, save_steps=1000)
    recipe_path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return recipe_path


def test_run_stopped_during_a_stage_exits_at_once_says_how_to_resume_and_resumes(micro_recipe: Path,
                                                                                  tmp_path: Path) -> None:
    micro_recipe = _with_a_long_sft(micro_recipe)
    command = [*LIFECYCLE, "run", str(micro_recipe)]
    home, first_err, second_err = tmp_path / "home", tmp_path / "first.err", tmp_path / "second.err"

    with started(command, home, first_err) as first:  # SIGTERM to the lifecycle process alone, as `kill PID`
        wait_for_text(first_err, "▶ sft", first)
        time.sleep(2)
        seconds = stop_and_time(first, whole_group=False)
        assert_stopped_cleanly(first, seconds, first_err, micro_recipe)
        assert group_alive(first.pid) == []  # Prefect's ephemeral server stopped with it

    # the same command resumes: the finished stages come from the cache; this time the whole group is stopped
    with started(command, home, second_err) as second:
        text = wait_for_text(second_err, "▶ sft", second)
        assert "✓ base from cache" in text and "✓ data from cache" in text, text[-3000:]
        time.sleep(2)
        seconds = stop_and_time(second, whole_group=True)
        assert_stopped_cleanly(second, seconds, second_err, micro_recipe)


def test_ui_stopped_by_sigterm_takes_its_mlflow_server_and_workers_with_it(tmp_path: Path) -> None:
    port, err = free_port(), tmp_path / "ui.err"
    with started([*LIFECYCLE, "ui", "--port", str(port)], tmp_path / "home", err) as ui:
        why_not = wait_until_ready(f"http://127.0.0.1:{port}/health", 300, alive=lambda: ui.poll() is None)
        assert why_not is None, f"{why_not}:\n{err.read_text()[-3000:]}"
        children = psutil.Process(ui.pid).children(recursive=True)
        assert children, "lifecycle ui runs mlflow ui as its child"
        try:
            seconds = stop_and_time(ui, whole_group=False)
            assert ui.returncode == 128 + signal.SIGTERM and seconds < STOP_WITHIN_S, (ui.returncode, seconds)
            _, alive = psutil.wait_procs(children, timeout=5)
            assert alive == [], [" ".join(p.cmdline()) for p in alive]
            with socket.socket() as probe:
                assert probe.connect_ex(("127.0.0.1", port)) != 0, f"port {port} still answers"
        finally:
            for child in children:  # in mlflow's own session: out of `started`'s reach once ui is gone
                with contextlib.suppress(psutil.Error):
                    child.kill()
