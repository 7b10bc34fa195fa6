"""Local-network helpers the fleet, the benchmarks and the tests share: a free port, and waiting for a server.

Standard library only (the gateway must not pull in anything heavier), so the readiness poll uses urllib.
"""

from __future__ import annotations

import http.client
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Callable


def free_port(host: str = "127.0.0.1") -> int:
    """A port the OS says is free now (another process may still take it before we bind: callers retry)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def answers_200(url: str, timeout: float = 2.0) -> bool:
    """Whether a GET of `url` answers 200 within `timeout` (refused, reset, timed out or another status: no)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:  # noqa: S310 (our own local URLs)
            return response.status == 200
    except (urllib.error.URLError, http.client.HTTPException, OSError, ValueError):  # refused, garbled, timed out
        return False


def wait_until_ready(url: str, timeout: float, *, alive: Callable[[], bool] | None = None,
                     interval: float = 0.1) -> str | None:
    """Poll `url` until it answers 200. Returns None when it does, else why not (gave up, or the process died).

    `alive` is asked between polls so a server that exits while starting is reported at once instead of after
    the whole timeout; callers turn the reason into their own error with the log they know about.
    """
    deadline = time.monotonic() + timeout
    while True:
        if answers_200(url):
            return None
        if alive is not None and not alive():
            return f"the process serving {url} exited before it answered"
        if time.monotonic() > deadline:
            return f"{url} did not answer 200 within {timeout:.0f} s"
        time.sleep(interval)
