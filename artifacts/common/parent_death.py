"""A child process that ends with its parent: Linux's parent-death signal, and a process name `ps` shows.

Why: a training worker, a fork server's child or a replica's server started by a Ray actor must not outlive the
process that started it (a killed stage's workers would train on beside its re-run; an actor's server would hold
its port). Elsewhere than Linux both calls do nothing.
"""

from __future__ import annotations

import os
import signal
import sys

PR_SET_PDEATHSIG, PR_SET_NAME = 1, 15


def _prctl(option: int, value: int | bytes) -> None:
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(option, value)
    except OSError:
        pass  # no glibc (a musl image): the best effort ends here


def die_with_parent(parent: int | None = None) -> None:
    """SIGKILL this process when its parent dies. With `parent` (the pid it expects as parent): exit at once if
    the parent already went before the signal was armed."""
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if parent is not None and os.getppid() != parent:
        os._exit(1)


def name_process(name: str) -> None:
    """The name `ps -o comm` and psutil's `name()` show (Linux keeps 15 bytes)."""
    _prctl(PR_SET_NAME, name.encode()[:15])
