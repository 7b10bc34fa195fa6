"""The engine-core process behind `lifecycle serve`: what users see when it dies, and what it leaves behind.

A real `python -m serving.cli serve` on 127.0.0.1 (the engine steps in its own process by default). The
fault is injected on purpose: SIGKILL to the engine-core process, as the kernel's OOM killer would.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import psutil
import pytest

from tests.serving.test_serving_cli import REPO, _start_server


def _engine_core(server: subprocess.Popen) -> psutil.Process:
    """The server's engine-core child (multiprocessing's spawn runs it as `python -c from multiprocessing...`)."""
    deadline = time.monotonic() + 30
    while True:
        cores = [c for c in psutil.Process(server.pid).children()
                 if "spawn_main" in " ".join(c.cmdline())]
        if cores:
            assert len(cores) == 1, [c.cmdline() for c in cores]
            return cores[0]
        assert time.monotonic() < deadline, "no engine-core process under the server"
        time.sleep(0.1)


def start_stream(base: str, max_tokens: int, timeout: float) -> tuple[list[str], threading.Thread]:
    """A streaming completion read in a thread: its `data:` payloads so far, and the thread, once the first
    token has come."""
    events: list[str] = []
    first_token = threading.Event()

    def stream() -> None:
        body = {"prompt": "Hello", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=timeout) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data:"):
                    events.append(line[len("data: "):])
                    first_token.set()

    reader = threading.Thread(target=stream)
    reader.start()
    assert first_token.wait(timeout), "the stream never started"
    return events, reader


def _stop(proc: subprocess.Popen) -> str:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.stdout.read().decode(errors="replace")


def test_a_killed_engine_process_ends_streams_with_503_and_turns_ready_false(tiny_model_dir):
    """Kill the engine core mid-stream: the stream ends at once with an error event and [DONE] (no hang),
    new requests get 503 with the cause, /ready and /health answer 503, the API process stays up to say so,
    and SIGTERM still stops it promptly."""
    server, base = _start_server(tiny_model_dir)
    try:
        core = _engine_core(server)
        events, reader = start_stream(base, max_tokens=200, timeout=30)
        killed_at = time.monotonic()
        core.send_signal(signal.SIGKILL)
        reader.join(timeout=15)
        assert not reader.is_alive(), "the stream hung after the engine process died"
        assert time.monotonic() - killed_at < 10

        assert events[-1] == "[DONE]", events[-3:]
        error = json.loads(events[-2])["error"]
        assert error["code"] == 503 and error["type"] == "service_unavailable"
        assert "killed by SIGKILL" in error["message"], error
        assert any(json.loads(e).get("choices") for e in events[:-2]), "no tokens streamed before the kill"

        r = httpx.post(f"{base}/v1/completions", json={"prompt": "Hello", "max_tokens": 4}, timeout=10)
        assert r.status_code == 503 and "engine is not running" in r.json()["error"]["message"]
        chat = httpx.post(f"{base}/v1/chat/completions", timeout=10,
                          json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
        assert chat.status_code == 503
        ready = httpx.get(f"{base}/ready", timeout=5)
        assert ready.status_code == 503 and ready.json()["ready"] is False
        assert httpx.get(f"{base}/health", timeout=5).status_code == 503
        assert server.poll() is None, "the API process should stay up and answer 503 until it is restarted"

        stopped_at = time.monotonic()
        log = _stop(server)
        assert server.returncode is not None and time.monotonic() - stopped_at < 15
        assert "engine stopped" in log and "killed by SIGKILL" in log, log
        assert "Traceback" not in log, log
    finally:
        _stop(server)


def test_the_engine_process_leaves_with_the_server(tiny_model_dir):
    """SIGTERM drains and stops both processes; SIGKILL of the server (no drain at all) still leaves no
    orphaned engine holding the model's memory: the core sees its pipe close and exits."""
    server, _ = _start_server(tiny_model_dir)
    core = _engine_core(server)
    said = _stop(server)
    assert server.returncode == 0
    core.wait(timeout=15)
    # both leave without the interpreter's teardown, but with multiprocessing's exit work: nothing leaked
    assert "leaked" not in said and "Traceback" not in said, said[-2000:]

    server, _ = _start_server(tiny_model_dir)
    core = _engine_core(server)
    server.kill()
    server.wait()
    try:
        core.wait(timeout=15)
    except psutil.TimeoutExpired:
        core.kill()
        pytest.fail("the engine-core process outlived a SIGKILLed server")
    _stop(server)


def test_a_model_the_engine_process_cannot_load_is_one_line_and_exit_2(tmp_path):
    """A directory whose weights the core cannot load: the server exits 2 with the core's one-line cause,
    and never binds its port."""
    model = tmp_path / "broken"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"],
                                                   "hidden_size": 8, "num_hidden_layers": 1,
                                                   "num_attention_heads": 2, "vocab_size": 16}))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-m", "serving.cli", "serve", str(model), "--port", "1"], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, done.stderr
    assert "Traceback" not in done.stderr
    assert lines[0].startswith(f"error: {model}: cannot load model") and "model.safetensors" in lines[0], lines


class _Observed:
    """Stands in for ServerMetrics: what the reader thread assembled, in order."""

    def __init__(self) -> None:
        self.outputs: list = []

    def observe(self, outputs: list) -> None:
        self.outputs += outputs


def test_outputs_over_the_pipe_are_the_engines_own(tiny_model_dir):
    """The core sends deltas; what the handlers get from the API side is what the engine builds in one process:
    ids, text (with a stop string cut), logprobs, prompt logprobs once complete. An aborted request ends on the
    API side too (the metrics see its last output) and leaves nothing behind."""
    import asyncio

    from serving.api.process_engine_client import ProcessEngineClient
    from serving.engine import EngineConfig, LLMEngine, SamplingParams

    cfg = EngineConfig(num_blocks=64, block_size=4, max_num_batched_tokens=16)
    prompts = {"lp": [40, 41, 42], "plp": [50, 51, 52, 53, 54], "stop": [60, 61], "abort": [70, 71]}
    params = {"lp": SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=2),
              "plp": SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, prompt_logprobs=1),
              "stop": SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=["e"]),
              "abort": SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)}
    engine = LLMEngine.from_pretrained(tiny_model_dir, cfg)
    want = dict(zip(prompts, engine.generate(list(prompts.values()), list(params.values())), strict=True))

    client = ProcessEngineClient(tiny_model_dir, cfg)
    client.metrics = observed = _Observed()

    async def serve() -> dict:
        client.start(asyncio.get_running_loop())
        queues = {rid: client.add(rid, prompts[rid], params[rid]) for rid in prompts}
        await queues["abort"].get()
        client.abort("abort")
        got = {}
        for rid in ("lp", "plp", "stop"):
            streamed = []
            while not streamed or not streamed[-1].finished:
                streamed.append(await asyncio.wait_for(queues[rid].get(), 60))
            got[rid] = streamed
        while not any(o.request_id == "abort" and o.finished for o in observed.outputs):
            await asyncio.sleep(0.05)
        return got

    try:
        got = asyncio.run(serve())
    finally:
        client.stop()
    for rid, streamed in got.items():
        last, ref = streamed[-1], want[rid]
        assert (last.token_ids, last.text, last.finish_reason, last.outputs[0].stop_reason) == \
               (ref.token_ids, ref.text, ref.finish_reason, ref.outputs[0].stop_reason), rid
        assert last.prompt_token_ids == prompts[rid]
        assert "".join(o.delta_text for o in streamed) == last.text
        assert [t for o in streamed for t in o.delta_token_ids] == last.token_ids
        for records, ref_records in ((last.outputs[0].logprobs, ref.outputs[0].logprobs),
                                     (last.prompt_logprobs, ref.prompt_logprobs)):
            assert (records is None) == (ref_records is None), rid
            for a, b in zip(records or [], ref_records or [], strict=True):
                assert (a is None and b is None) or a == pytest.approx(b, abs=1e-4), rid
    assert want["stop"].finish_reason == "stop" and "e" not in got["stop"][-1].text
    aborted = [o for o in observed.outputs if o.request_id == "abort"]
    assert aborted[-1].finish_reason == "abort" and aborted[-1].token_ids
    assert len(client._assembler) == 0
