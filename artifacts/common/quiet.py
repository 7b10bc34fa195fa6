"""Keep third-party noise out of the user's terminal without losing it.

Libraries such as gptqmodel print banners, per-layer tables and their own progress bars to stdout/stderr,
some of it from C. ``output_to_log`` sends both file descriptors to a log file while such a library runs and
shows one line with the elapsed time on the real terminal instead; the full output stays in the log, whose
path the line names. ``quiet_warnings`` silences deprecation chatter that says nothing to our users.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time
import warnings
from collections.abc import Iterator
from pathlib import Path

# Loggers that warn about optional accelerators this project never uses (triton, CUDA-only extensions).
NOISY_LOGGERS = ("torchao", "torchao.kernel.intmm", "torch.utils._pytree")


def quiet_warnings() -> None:
    """FutureWarnings/DeprecationWarnings from dependencies, and accelerator probes that cannot apply here."""
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    for name in NOISY_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)


def _repoint_handlers(old: object, new: object) -> None:
    """Logging handlers a library set up while ``old`` stood in for stderr write to ``new`` from now on
    (``old`` is about to be closed; a record logged through them would print "--- Logging error ---")."""
    loggers = [logging.getLogger(), *(lg for lg in logging.Logger.manager.loggerDict.values()
                                      if isinstance(lg, logging.Logger))]
    for lg in loggers:
        for handler in lg.handlers:
            if isinstance(handler, logging.StreamHandler) and handler.stream is old:
                handler.setStream(new)


@contextlib.contextmanager
def _fds_to(log_path: str | Path) -> Iterator[None]:
    """fd 1 and 2, and Python's sys.stdout/sys.stderr, write to ``log_path`` for the block (appended)."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    saved_out, saved_err = os.dup(1), os.dup(2)
    python_streams = sys.stdout, sys.stderr
    with open(log_path, "ab") as log, open(log_path, "a", buffering=1, encoding="utf-8") as text_log:
        os.dup2(log.fileno(), 1)  # what C code writes
        os.dup2(log.fileno(), 2)
        sys.stdout = sys.stderr = text_log  # what Python writes, even where sys.stdout is not fd 1 (pytest)
        try:
            yield
        finally:
            sys.stdout, sys.stderr = python_streams
            _repoint_handlers(text_log, python_streams[1])
            os.dup2(saved_out, 1)
            os.dup2(saved_err, 2)
            os.close(saved_out)
            os.close(saved_err)


@contextlib.contextmanager
def output_to_log(log_path: str | Path, label: str) -> Iterator[None]:
    """Redirect fd 1 and 2 to ``log_path`` for the block; show ``label`` and elapsed time on the terminal."""
    log_path = Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    terminal = os.fdopen(os.dup(2), "w", buffering=1)
    interactive = terminal.isatty()
    stop = threading.Event()
    started = time.monotonic()

    def tick() -> None:
        while not stop.wait(1.0):
            terminal.write(f"\r  {label}: {time.monotonic() - started:4.0f} s (details: {log_path})")
            terminal.flush()

    ticker = threading.Thread(target=tick, daemon=True) if interactive else None
    if not interactive:
        terminal.write(f"  {label} (details: {log_path})\n")
    try:
        with _fds_to(log_path):
            if ticker is not None:
                ticker.start()
            try:
                yield
            finally:
                stop.set()
                if ticker is not None:
                    ticker.join(timeout=2)
    finally:
        if interactive:
            terminal.write(f"\r  {label}: {time.monotonic() - started:4.0f} s\x1b[K\n")
        terminal.close()


@contextlib.contextmanager
def quietly(log_path: str | Path | None = None) -> Iterator[None]:
    """A library's chatter goes to ``log_path`` (nowhere when None), with no line of ours on the terminal: for
    gptqmodel's import banner (peft imports it to probe for GPTQ layers, even on a plain model) and the INFO
    lines it prints while transformers loads a quantized checkpoint, where our caller already says what it is
    doing. Failures still arrive as exceptions."""
    if log_path is not None:
        Path(log_path).parent.mkdir(parents=True, exist_ok=True)
    with _fds_to(log_path if log_path is not None else os.devnull):
        yield


def import_quietly(module: str) -> None:
    """Import ``module`` (if installed and not yet imported) with its import-time banner sent nowhere."""
    import importlib
    import importlib.util

    if module in sys.modules or importlib.util.find_spec(module) is None:
        return
    with quietly():
        importlib.import_module(module)


def is_quantized_checkpoint(model_dir: str | Path) -> bool:
    """Whether a checkpoint's config.json names a ``quantization_config`` (GPTQ/AWQ: transformers loads it
    through gptqmodel). An unreadable config counts as not quantized: the loader reports it."""
    import json

    try:
        return "quantization_config" in json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return False


def quiet_if_quantized(model_dir: str | Path) -> contextlib.AbstractContextManager[None]:
    """``quietly()`` while a GPTQ/AWQ checkpoint loads (gptqmodel prints its kernel choice and format
    conversions); a plain checkpoint loads with its own progress bar."""
    return quietly() if is_quantized_checkpoint(model_dir) else contextlib.nullcontext()
