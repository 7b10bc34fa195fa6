"""SIGTERM and SIGINT as one exception in the main thread, so a stopped command unwinds like a Ctrl-C.

Why an exception rather than dying: `finally` blocks and `with` blocks then run on the way out (a training
stage's workers are stopped, MLflow runs are ended, a child server is stopped), and the command prints its own
one-line answer instead of the interpreter's traceback. SIGTERM gets the same treatment as SIGINT because that
is what a supervisor, `kill` or a scheduler's timeout sends.

Prefect's flow engine installs its own SIGTERM handler for the length of a flow run (it reports the run as
crashed to its API before the process dies). A flow run started by a command that installed `StopSignals`
calls `reclaim()` first thing, so the command, not Prefect, decides how the run stops.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

__all__ = ["STOP_SIGNALS", "StopRequested", "StopSignals", "reclaim"]

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)

_active: StopSignals | None = None  # the handlers a command installed in this process, if any


class StopRequested(BaseException):
    """The first SIGTERM or SIGINT. A BaseException, like KeyboardInterrupt, so that no `except Exception` on
    the way (a stage's retry, a hook that must never raise) mistakes the stop for an error and carries on."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        super().__init__(self.signal_name)

    @property
    def signal_name(self) -> str:
        return signal.Signals(self.signum).name

    @property
    def exit_status(self) -> int:
        """128 + the signal's number, as a shell reports a process the signal ended: 143 for TERM, 130 for INT."""
        return 128 + self.signum


@dataclass
class StopSignals:
    """While entered (in the main thread), the first SIGTERM or SIGINT calls `on_first` and raises
    `StopRequested`; any later one calls `on_repeat` (nothing is raised twice into code already unwinding)."""

    on_first: Callable[[int], None] | None = None
    on_repeat: Callable[[int], None] | None = None
    received: int | None = None
    _previous: dict[int, Any] = field(default_factory=dict)

    def handle(self, signum: int, frame: FrameType | None) -> None:
        if self.received is not None:
            if self.on_repeat is not None:
                self.on_repeat(signum)
            return
        self.received = signum
        if self.on_first is not None:
            self.on_first(signum)
        raise StopRequested(signum)

    def install(self) -> None:
        """Put this object's handler on every stop signal; the first call remembers the handlers it replaces.
        Outside the main thread, where Python cannot set handlers, the signals keep theirs."""
        if threading.current_thread() is not threading.main_thread():
            return
        for signum in STOP_SIGNALS:
            previous = signal.signal(signum, self.handle)
            self._previous.setdefault(signum, previous)

    def __enter__(self) -> StopSignals:
        global _active
        self.install()
        if self._previous:  # installed: this is the main thread
            _active = self
        return self

    def __exit__(self, *exc_info: object) -> None:
        global _active
        if _active is self:
            _active = None
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)
        self._previous.clear()


def reclaim() -> None:
    """Take the stop signals back from whoever replaced the handlers of the command's `StopSignals` (Prefect's
    flow engine does on entering a flow run). Nothing happens in a process without one (a flow run started by
    a Prefect worker keeps Prefect's handling) or outside the main thread, where handlers cannot be set."""
    if _active is not None:
        _active.install()
