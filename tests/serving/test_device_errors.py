"""A device error ends the engine, its process and the server (non-zero), where any other error fails one request.

CPU CI has no device to fail, so the fault is injected on purpose (``tests/serving/device_fault.py``, mode
``mock``): the RuntimeError torch raises after an illegal memory access, raised from the step for a marked
request. Everything around it is real: the engine, the engine-core process, the server and its exit. The
same path with a real device-side assert runs in ``test_cuda.py`` on a GPU.
"""

from __future__ import annotations

import json

import httpx
import pytest
import torch

from serving.engine import EngineConfig, LLMEngine, SamplingParams
from serving.engine.core_process import CoreFailed
from serving.engine.device_errors import DEVICE_ERROR_EXIT, describe_device_error, is_device_error
from tests.serving import device_fault
from tests.serving.test_engine_process import start_stream
from tests.serving.test_serving_cli import REPO, _start_server

ASSERT_TEXT = ("CUDA error: device-side assert triggered\nCUDA kernel errors might be asynchronously reported at "
               "some other API call, so the stacktrace below might be incorrect.\nFor debugging consider passing "
               "CUDA_LAUNCH_BLOCKING=1")
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def _chained() -> BaseException:
    try:
        try:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        except RuntimeError as inner:
            raise ValueError("sampling failed") from inner
    except ValueError as outer:
        return outer


@pytest.mark.parametrize(("exc", "device"), [
    (torch.AcceleratorError(ASSERT_TEXT), True),
    (RuntimeError(ASSERT_TEXT), True),
    (RuntimeError("CUDA error: an illegal memory access was encountered"), True),
    (RuntimeError("CUDA error: unspecified launch failure"), True),
    (_chained(), True),  # wrapped by our own code on the way out
    (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), False),  # nothing is poisoned
    (IndexError("index out of range in self"), False),  # the same bad index on CPU: one request's error
    (RuntimeError("The size of tensor a (4) must match the size of tensor b (5)"), False),
    (ValueError("Overflow when unpacking long long"), False),
])
def test_device_errors_are_told_from_request_errors(exc, device):
    assert is_device_error(exc) is device


def test_a_device_error_is_described_in_one_line():
    line = describe_device_error(RuntimeError(ASSERT_TEXT))
    assert "\n" not in line
    assert line.startswith("device error: RuntimeError: CUDA error: device-side assert triggered (CUDA reports")


@pytest.fixture()
def engine(tiny_model_dir) -> LLMEngine:
    return LLMEngine.from_pretrained(tiny_model_dir, EngineConfig(device="cpu", num_blocks=64, block_size=4))


def test_the_step_raises_a_device_error_instead_of_isolating_it(engine, monkeypatch):
    """The executor re-runs a failed batch per sequence for any other error; a device error leaves the step."""
    real = engine.executor.sampler.launch

    def launch(logits, seqs, *extra):  # injected fault: the device fails under request "poison"
        if any(s.request_id == "poison" for s in seqs):
            raise torch.AcceleratorError(ASSERT_TEXT)
        return real(logits, seqs, *extra)

    monkeypatch.setattr(engine.executor.sampler, "launch", launch)
    engine.add_request("a", [10, 11, 12], GREEDY)
    engine.add_request("poison", [20, 21, 22], GREEDY)
    with pytest.raises(torch.AcceleratorError):
        engine.step()


def test_an_out_of_range_index_on_cpu_stays_one_requests_error(engine):
    """The fault test_cuda.py makes a real device-side assert of, here on CPU: an IndexError, isolated."""
    undo = device_fault.install("index")
    try:
        outs = engine.generate([[10, 11, 12], list(device_fault.POISON)], GREEDY)
    finally:
        undo()
    assert [o.finish_reason for o in outs] == ["length", "error"]
    assert "index out of range" in outs[1].error


def test_the_engine_core_exits_with_its_device_error_status(tiny_model_dir):
    messages, exitcode = device_fault.run_core_until_it_ends(tiny_model_dir, "mock",
                                                            EngineConfig(device="cpu", num_blocks=64, threads=1))
    failed = messages[-1]
    assert isinstance(failed, CoreFailed) and failed.device_error, messages[-1]
    assert "illegal memory access" in failed.error and "\n" not in failed.error
    assert exitcode == DEVICE_ERROR_EXIT


@pytest.mark.parametrize("engine_process", [True, False], ids=["engine-process", "engine-thread"])
def test_a_device_error_ends_in_flight_requests_with_503_and_the_server_exits_non_zero(tiny_model_dir,
                                                                                      engine_process):
    """A stream in flight, then a poisoned request: both end with 503 naming the device error (the stream with
    an error event and [DONE]), /ready never answers 200 again, and the server exits 2 with one line, so the
    fleet (a Ray actor's restart, any supervisor) replaces it."""
    extra = () if engine_process else ("--no-engine-process",)
    server, base = _start_server(tiny_model_dir, *extra, entry=(str(REPO / "tests/serving/device_fault.py"),),
                                 env={device_fault.ENV: "mock"})
    try:
        events, reader = start_stream(base, max_tokens=400, timeout=60)
        poison = httpx.post(f"{base}/v1/completions", timeout=60,
                            json={"prompt": list(device_fault.POISON), "max_tokens": 4})
        assert poison.status_code == 503 and "illegal memory access" in poison.json()["error"]["message"]
        try:
            assert httpx.get(f"{base}/ready", timeout=5).status_code == 503
        except httpx.TransportError:
            pass  # already gone: not ready either
        reader.join(timeout=30)
        assert not reader.is_alive(), "the stream hung after the device error"
        assert events[-1] == "[DONE]", events[-3:]
        error = json.loads(events[-2])["error"]
        assert error["code"] == 503 and "device error" in error["message"], error

        assert server.wait(timeout=60) == 2
        log = server.stdout.read().decode(errors="replace")
        errors = [line for line in log.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and "illegal memory access" in errors[0], log
        assert "replica is replaced" in errors[0]
        if engine_process:
            assert f"exited with code {DEVICE_ERROR_EXIT}" in errors[0], log
        assert "Traceback" not in log, log
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
