"""End a process that has finished its work without the interpreter's teardown.

A process that has loaded torch, transformers and a model spends seconds at exit freeing modules and tensors
one by one (about 2 s on an idle 2-core host, over 10 s on a loaded one). For a server that has already
drained and stopped, that is time a supervisor, a rolling restart or a test waits for nothing. ``exit_now``
runs multiprocessing's own exit work (its finalizers unlink named semaphores, such as the lock tqdm makes for
a progress bar; skipped, Python's resource tracker warns of a leak), flushes what could still be buffered
(logging handlers, Python's std streams) and leaves with ``os._exit``.
Only for the end of a process's whole life, never from library code a caller might continue after.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from typing import NoReturn


def exit_now(status: int = 0) -> NoReturn:
    if "multiprocessing.util" in sys.modules:
        sys.modules["multiprocessing.util"]._exit_function()  # what multiprocessing registers with atexit
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(status)
