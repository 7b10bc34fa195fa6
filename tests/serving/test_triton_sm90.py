"""Every Triton kernel the engine launches at the 1B benchmark model's shapes compiles for sm_90 (H100/H200) within
the chip's shared memory, no GPU needed (``tests/serving/sm90_launches.py`` says how and why: the interpreter
checks no resource limit, and a 4-bit GEMM tile that needed 240 KB of the 227 KB failed on the first GPU run)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.serving.sm90_launches import GROUPS, SHARED_LIMIT

pytest.importorskip("triton")
REPO = Path(__file__).resolve().parents[2]


def test_launches_fit_the_shared_memory_of_sm90():
    """One subprocess for every group (triton without the interpreter; each launch compiled for sm_90)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-m", "tests.serving.sm90_launches", *sorted(GROUPS)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert {r["group"] for r in rows} == set(GROUPS), done.stdout[-2000:]
    over = [r for r in rows if r["shared"] > SHARED_LIMIT]
    assert not over, over
    # the row-wise kernels move little data per thread: unless their loads are 16 bytes wide they are slow
    narrow = [r for r in rows if r["kernel"] in ("_add_rms_norm_kernel", "_silu_mul_kernel", "_dense_gemv") and
              not r["loads_16_bytes"]]
    assert not narrow, narrow
