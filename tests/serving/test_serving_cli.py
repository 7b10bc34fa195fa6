"""`serve` CLI: argument handling, and a real server process that drains on SIGTERM."""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from artifacts.common.net import free_port
from serving.cli import ServeError, cmd_serve, engine_config_from_args, kv_memory_bytes, main, register_cli

REPO = Path(__file__).resolve().parents[2]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    register_cli(p.add_subparsers(dest="cmd"))
    return p


def test_kv_memory_flag_reads_sizes_and_names_itself_when_it_cannot():
    assert kv_memory_bytes("512MiB") == 512 * 1024 ** 2
    with pytest.raises(ServeError, match="--kv-memory: cannot parse size 'lots'"):
        kv_memory_bytes("lots")


def test_serve_arguments_map_to_engine_config(tmp_path):
    args = parser().parse_args(["serve", str(tmp_path), "--kv-memory", "64MiB", "--max-num-seqs", "8",
                                "--no-prefix-caching", "--port", "9000"])
    cfg = engine_config_from_args(args)
    assert cfg.kv_memory_bytes == 64 * 1024 ** 2 and cfg.max_num_seqs == 8 and not cfg.enable_prefix_caching
    assert args.func is cmd_serve and args.port == 9000


def test_gpu_path_flags_map_to_engine_config(tiny_model_dir):
    """--attention-backend and --enforce-eager reach the config; a backend not offered is argparse's error."""
    args = parser().parse_args(["serve", str(tiny_model_dir), "--attention-backend", "torch", "--enforce-eager"])
    cfg = engine_config_from_args(args)
    assert cfg.attention_backend == "torch" and cfg.enforce_eager
    assert engine_config_from_args(parser().parse_args(["serve", str(tiny_model_dir)])).attention_backend == "auto"
    with pytest.raises(SystemExit):
        parser().parse_args(["serve", str(tiny_model_dir), "--attention-backend", "flash"])


def test_device_memory_flags_map_and_bad_values_are_one_line(tiny_model_dir, capsys):
    """--gpu-memory-utilization reaches the config; out of (0, 1] it is one line and exit 2 before anything
    loads. --kv-memory left out means the device sizes the cache (256 MiB on CPU, a share of a GPU)."""
    args = parser().parse_args(["serve", str(tiny_model_dir), "--gpu-memory-utilization", "0.5"])
    cfg = engine_config_from_args(args)
    assert cfg.gpu_memory_utilization == 0.5 and cfg.kv_memory_bytes is None and cfg.dtype == "auto"
    for bad in ("1.5", "0", "-0.1", "nan"):
        assert main(["serve", str(tiny_model_dir), "--gpu-memory-utilization", bad]) == 2
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and err.startswith("error: serve: gpu_memory_utilization: must be in (0, 1]"), err


def test_a_max_model_len_beyond_the_model_is_one_line_and_exit_2(tiny_model_dir):
    """The engine core refuses a context the model cannot serve (the tiny model's is 512) rather than cut it
    silently; the server exits 2 with that line before it binds its port."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-m", "serving.cli", "serve", str(tiny_model_dir), "--port", "1",
                           "--threads", "1", "--max-model-len", "4096"], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 2, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert lines == ["error: --max-model-len 4096: the model's context is 512 tokens (max_position_embeddings); "
                     "lower --max-model-len"], done.stderr
    assert "Traceback" not in done.stderr


def test_bad_model_dir_is_one_line_error(tmp_path, capsys):
    assert main(["serve", str(tmp_path / "missing")]) == 2
    assert "not a directory" in capsys.readouterr().err
    with pytest.raises(ServeError, match="config.json"):
        cmd_serve(parser().parse_args(["serve", str(tmp_path)]))
    with pytest.raises(ServeError, match="block_size"):
        engine_config_from_args(parser().parse_args(["serve", str(tmp_path), "--block-size", "3"]))


def test_a_bundle_that_fails_verification_is_never_served(tiny_model_dir, tmp_path, capsys):
    import shutil

    bundle = tmp_path / "bundle"
    shutil.copytree(tiny_model_dir, bundle)
    (bundle / "manifest.json").write_text('{"name": "tampered"}')
    assert main(["serve", str(bundle), "--port", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and len(err.strip().splitlines()) == 1


def _in_flight(base: str) -> float:
    text = httpx.get(f"{base}/metrics").text
    return sum(float(m.group(1)) for m in re.finditer(
        r"^vllm:num_requests_(?:running|waiting)\{[^}]*\} (\S+)$", text, re.MULTILINE))


@pytest.mark.slow
def test_sigterm_drains_in_flight_then_exits(micro_base_dir):
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-m", "serving.cli", "serve", str(micro_base_dir), "--port", str(port),
                             "--served-model-name", "micro", "--threads", "1", "--max-num-seqs", "1",
                             "--log-level", "warning"],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.stdout.read().decode()
            try:
                if httpx.get(f"{base}/ready", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline
            time.sleep(0.2)
        results: list[dict] = [{"lines": []} for _ in range(8)]

        def stream(out: dict):
            body = {"model": "micro", "prompt": "Once", "max_tokens": 250, "ignore_eos": True, "stream": True}
            with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=120) as r:
                out["status"] = r.status_code
                out["lines"].extend(line for line in r.iter_lines() if line.startswith("data:"))

        # one running sequence at a time, so eight long streams keep the server busy for a while
        threads = [threading.Thread(target=stream, args=(out,)) for out in results]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 30
        while _in_flight(base) < 6:  # one running and several queued when SIGTERM lands
            assert time.monotonic() < deadline
            time.sleep(0.01)
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.05)
        assert httpx.get(f"{base}/ready").status_code == 503
        r = httpx.post(f"{base}/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=10)
        assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable"
        for t in threads:
            t.join(timeout=120)
        admitted = [out for out in results if out.get("status") == 200]
        assert len(admitted) >= 6
        assert all(out["lines"][-1] == "data: [DONE]" for out in admitted)  # in-flight work finished
        assert all(out.get("status") in (200, 503) for out in results)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_serve_flag_defaults_are_engine_config_defaults(tmp_path):
    """One source for the defaults: `lifecycle serve DIR` with no flags runs exactly `EngineConfig()`."""
    from serving.engine import EngineConfig

    args = parser().parse_args(["serve", str(tmp_path)])
    assert engine_config_from_args(args) == EngineConfig()
    defaults = EngineConfig()
    for flag in ("block_size", "max_num_seqs", "max_num_batched_tokens", "max_queue", "max_model_len", "num_blocks",
                 "dtype", "device", "threads"):
        assert getattr(args, flag) == getattr(defaults, flag), flag
    assert kv_memory_bytes(args.kv_memory) == defaults.kv_memory_bytes


def _start_server(model_dir: Path, *extra: str, entry: tuple[str, ...] = ("-m", "serving.cli"),
                  env: dict[str, str] | None = None) -> tuple[subprocess.Popen, str]:
    """A real `serve` process on a free port, once /ready answers; ``entry`` and ``env`` (added to this
    process's) let a test start it through a wrapper (tests/serving/device_fault.py)."""
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
    proc = subprocess.Popen([sys.executable, *entry, "serve", str(model_dir), "--port", str(port),
                             "--served-model-name", "micro", "--threads", "1", *extra],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        assert proc.poll() is None, proc.stdout.read().decode()
        try:
            if httpx.get(f"{base}/ready", timeout=2).status_code == 200:
                return proc, base
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, "server never became ready"
        time.sleep(0.2)


@pytest.fixture(scope="module")
def long_context_model_dir(tmp_path_factory) -> Path:
    """The tiny test model with room for streams long enough to outlast a short drain timeout."""
    from tests.serving.conftest import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-long"), max_pos=8192)


def test_sigterm_ends_streams_at_the_drain_timeout_and_exits(long_context_model_dir):
    """`--drain-timeout 3` with long streams in flight: the process is gone a few seconds after it, and every
    client's answer ends well-formed: a stream with an error event then [DONE] (our gateway continues such a
    stream on another replica), a non-streaming request with a 503 error body."""
    drain = 3.0
    proc, base = _start_server(long_context_model_dir, "--drain-timeout", str(drain), "--max-num-seqs", "2",
                               "--log-level", "info")
    try:
        streams: list[dict] = [{"lines": []} for _ in range(3)]
        plain: dict = {}

        def stream(out: dict):
            body = {"model": "micro", "prompt": "Once", "max_tokens": 6000, "ignore_eos": True, "stream": True}
            try:
                with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=120) as r:
                    out["status"] = r.status_code
                    for line in r.iter_lines():
                        if line.startswith("data:"):
                            out["lines"].append(line)
            except httpx.HTTPError as e:  # a cut connection: the failure this test is about
                out["error"] = repr(e)

        def non_streaming():
            body = {"model": "micro", "prompt": "Once", "max_tokens": 6000, "ignore_eos": True}
            try:
                r = httpx.post(f"{base}/v1/completions", json=body, timeout=120)
                plain["status"], plain["body"] = r.status_code, r.json()
            except httpx.HTTPError as e:
                plain["error"] = repr(e)

        threads = [threading.Thread(target=stream, args=(out,)) for out in streams]
        threads.append(threading.Thread(target=non_streaming))
        for t in threads:
            t.start()
        deadline = time.monotonic() + 30
        # every stream admitted (its 200 came: a queued one's too) and tokens flowing; on a loaded host the
        # third request could otherwise reach the server after SIGTERM and rightly get a 503 instead
        while (not all(out.get("status") for out in streams)
               or len(streams[0]["lines"]) + len(streams[1]["lines"]) + len(streams[2]["lines"]) < 20):
            assert time.monotonic() < deadline, "streams never started"
            time.sleep(0.05)
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        try:
            rc = proc.wait(timeout=drain + 6)
        except subprocess.TimeoutExpired:
            pytest.fail(f"still running {drain + 6:.0f}s after SIGTERM with --drain-timeout {drain:.0f}")
        took = time.monotonic() - sent
        for t in threads:
            t.join(timeout=10)
        log = proc.stdout.read().decode()
        assert rc == 0, log
        assert took >= drain - 0.5, f"exited after {took:.1f}s, before the drain timeout"
        for out in streams:
            assert out["status"] == 200 and "error" not in out, out.get("error")
            assert out["lines"][-1] == "data: [DONE]", out["lines"][-3:]
            last = json.loads(out["lines"][-2][len("data:"):])
            assert last["error"]["type"] == "service_unavailable" and "drain timeout" in last["error"]["message"]
            chunks = [json.loads(line[len("data:"):]) for line in out["lines"][:-2]]
            assert all(c["choices"][0]["finish_reason"] is None for c in chunks)  # cut short, and says so
        assert plain["status"] == 503, plain
        assert plain["body"]["error"]["type"] == "service_unavailable", plain
        assert "Exception in ASGI application" not in log and "Traceback" not in log, log
        assert "drain timeout" in log, log  # the operator sees why requests were cut short
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
