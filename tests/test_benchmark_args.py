"""The serving benchmark finds vLLM's python from a flag or the environment, never from a machine's path."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

SERVING = Path(__file__).resolve().parents[1] / "benchmarks" / "serving.py"


def _module():
    spec = importlib.util.spec_from_file_location("bench_serving", SERVING)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


def test_the_flag_wins_then_the_environment_then_nothing():
    bench = _module()
    assert bench.vllm_python_from(None, {}) is None
    assert bench.vllm_python_from(None, {"VLLM_PYTHON": ""}) is None
    assert bench.vllm_python_from(None, {"VLLM_PYTHON": "/e/python"}) == "/e/python"
    assert bench.vllm_python_from("/f/python", {"VLLM_PYTHON": "/e/python"}) == "/f/python"
    assert "/work/vllm-venv" not in SERVING.read_text()


def test_a_peer_python_that_is_not_there_is_one_line_not_a_traceback(tmp_path):
    """`--vllm-python` or `$VLLM_PYTHON` naming a missing file: the benchmark ends with one line naming it."""
    from benchmarks.servers import BenchError, launch

    children: list = []
    with pytest.raises(BenchError, match=r"^vllm-cpu: cannot start /nonexistent/python \(No such file or directory\)$"):
        launch(children, "vllm-cpu", ["/nonexistent/python", "-m", "vllm"], tmp_path / "vllm.log", {},
               "http://127.0.0.1:9", timeout_s=1)
    assert children == []  # nothing started, nothing to stop
