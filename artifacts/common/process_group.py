"""Stop a child process together with every process it started.

Why a group: a server such as `mlflow ui` starts workers of its own, and terminating only the child we started
leaves them holding the port. A child started with `start_new_session=True` leads a process group of its own,
so one signal to the group reaches all of them; and a Ctrl-C in the terminal, which goes to the terminal's
foreground group, no longer reaches them behind the parent's back: the parent decides when they stop.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time

__all__ = ["terminate_group"]


def _signal_group(pgid: int, signum: int) -> None:
    try:
        os.killpg(pgid, signum)
    except (ProcessLookupError, PermissionError):
        pass  # the group is gone


def terminate_group(proc: subprocess.Popen, grace: float = 10.0) -> int:
    """SIGTERM the group that `proc` leads (started with `start_new_session=True`), SIGKILL the group if `proc`
    or any process it started still runs after `grace` seconds, and return `proc`'s exit status."""
    import psutil

    try:
        descendants = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        descendants = []
    _signal_group(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    try:
        proc.wait(timeout=grace)
        leader_done = True
    except subprocess.TimeoutExpired:
        leader_done = False
    # the descendants are not our children: psutil polls them (proc itself is left for Popen to reap)
    _, alive = psutil.wait_procs(descendants, timeout=max(0.0, deadline - time.monotonic()))
    if alive or not leader_done:
        _signal_group(proc.pid, signal.SIGKILL)
    return proc.wait()
