"""A device fault injected on purpose, for the device-error tests: a request whose prompt starts with ``POISON``.

Two faults (``ENV`` picks one):
- ``mock``: the step raises the RuntimeError torch raises after an illegal memory access. A stand-in, so CPU
  CI can prove what a device error does to the engine, its process and the server.
- ``index``: the request's first token becomes an id past the vocabulary before the real forward runs. On a
  GPU that is a real device-side assert in the embedding kernel; on CPU, a plain IndexError of one request.

Used two ways: ``run_core`` is an engine-core process target with the fault installed; and as the server's
main file (``python tests/serving/device_fault.py serve ...``), whose top level multiprocessing's spawn runs
again in the engine-core process, so the fault is installed there too, from the environment.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

POISON = (3, 1, 4, 1, 5, 9, 2, 6)
ENV = "LIFECYCLE_TEST_DEVICE_FAULT"
MOCK_ERROR = ("CUDA error: an illegal memory access was encountered\nCUDA kernel errors might be asynchronously "
              "reported at some other API call, so the stacktrace below might be incorrect.")


def poisoned(prompt_token_ids: list[int]) -> bool:
    return tuple(prompt_token_ids[:len(POISON)]) == POISON


def install(mode: str) -> Callable[[], None]:
    """Patch the executor's step (in this process) to fail the way ``mode`` says for poisoned requests;
    returns what undoes it."""
    if mode not in ("mock", "index"):
        raise ValueError(f"{ENV}: 'mock' or 'index', got {mode!r}")
    from serving.engine.executor import ModelExecutor

    real = ModelExecutor._launch

    def launch(self, scheduled, *rest):
        bad = [item.seq for item in scheduled if poisoned(item.seq.prompt_token_ids)]
        if bad and mode == "mock":
            raise RuntimeError(MOCK_ERROR)
        for seq in bad:  # "index": past the API's validation, into the real forward
            seq.token_ids[0] = self.runner.vocab_size + 1000
        return real(self, scheduled, *rest)

    ModelExecutor._launch = launch

    def undo() -> None:
        ModelExecutor._launch = real

    return undo


def run_core(mode: str, *args) -> None:
    """``serving.engine.core_process.run_engine_core`` with the fault installed."""
    install(mode)
    from serving.engine.core_process import run_engine_core

    run_engine_core(*args)


def run_core_until_it_ends(model_dir, mode: str, config, timeout: float = 180) -> tuple[list, int | None]:
    """The engine-core process (with ``config``) and ``mode``'s fault: a healthy request, then a poisoned one;
    the messages it sent until it ended, and its exit status."""
    import multiprocessing
    import time

    from serving.engine.core_process import AddRequest, CoreReady
    from serving.engine.sampling_params import SamplingParams

    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=run_core, args=(mode, str(model_dir), config, child), daemon=True)
    proc.start()
    child.close()
    messages = []
    try:
        assert parent.poll(timeout), "the engine core never answered"
        messages.append(parent.recv())
        assert isinstance(messages[0], CoreReady), messages
        long = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
        parent.send([AddRequest("healthy", [10, 11, 12], long, time.monotonic())])
        short = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
        parent.send([AddRequest("poison", list(POISON), short, time.monotonic())])
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and parent.poll(deadline - time.monotonic()):
            try:
                messages.append(parent.recv())
            except EOFError:
                break
        proc.join(30)
        return messages, proc.exitcode
    finally:
        if proc.is_alive():
            proc.kill()
        parent.close()


if os.environ.get(ENV):  # the server run as this file, and its engine core (spawn runs this top level again)
    install(os.environ[ENV])

if __name__ == "__main__":
    from serving.cli import main

    sys.exit(main())
