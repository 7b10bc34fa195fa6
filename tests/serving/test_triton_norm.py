"""The fused residual-add + RMSNorm and SiLU-gate kernels against the torch code they replace: under triton's CPU
interpreter here, compiled on a GPU where there is one (``pytest tests/serving/test_triton_norm.py`` on the device
runs the same tests on CUDA tensors); ``test_triton_sm90`` compiles the launches for sm_90 without one.

Outputs are poisoned with NaN before each call, so an element a kernel forgot to write fails the comparison. As in
``test_triton_attention``, the interpreter must be on before triton is first imported: run alone this module
switches it on; where an earlier module imported triton without it, ``test_the_module_in_a_fresh_interpreter``
runs the module again in a new process.

The interpreter casts fp32 to bf16 by truncation (``triton.runtime.interpreter._convert_float`` without a
rounding mode), where a GPU rounds to nearest even as torch does: bf16 results match torch bit for bit on CUDA
and to one unit in the last place more under the interpreter."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

ON_CUDA = torch.cuda.is_available()
if not ON_CUDA:
    os.environ["TRITON_INTERPRET"] = "1"
triton = pytest.importorskip("triton")

from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from serving.engine import triton_norm as tn  # noqa: E402

IN_PROCESS = isinstance(triton.language.max, InterpretedFunction)
if IN_PROCESS and not tn.interpreted():  # the kernel module alone was imported before the switch: decorate again
    tn = importlib.reload(tn)
in_process = pytest.mark.skipif(not (IN_PROCESS or ON_CUDA), reason="triton was imported before TRITON_INTERPRET=1 "
                                "was set: test_the_module_in_a_fresh_interpreter runs these")
DEVICE = "cuda" if ON_CUDA else "cpu"
REPO = Path(__file__).resolve().parents[2]

EPS = 1e-5
# Against torch's unfused ops: fp32 the same math up to summation order; fp16/bf16 a unit in the last place or two
# where an fp32 intermediate lands next to a rounding boundary (relative ulp: fp16 2^-10, bf16 2^-7).
TOL = {torch.float32: {"atol": 1e-5, "rtol": 1e-5}, torch.float16: {"atol": 2e-3, "rtol": 2e-3},
       torch.bfloat16: {"atol": 1.6e-2, "rtol": 1.6e-2}}


def _truncates(dtype: torch.dtype) -> bool:
    """The interpreter truncates fp32 to bf16 where a GPU (and torch) rounds to nearest even."""
    return dtype == torch.bfloat16 and not ON_CUDA


def _ulps(dtype: torch.dtype, n: int) -> dict[str, float]:
    """A tolerance of ``n`` units in the last place (one more where the interpreter truncates), and none for
    subnormals (silu(-100) is -0 in torch's ``x / (1 + exp(-x))``, -3.7e-42 in the kernel's overflow-free form)."""
    info = torch.finfo(dtype)
    return {"atol": info.tiny, "rtol": (n + _truncates(dtype)) * info.eps}


def _assert_rounded_like(got: torch.Tensor, want: torch.Tensor) -> None:
    """``got`` rounds as ``want`` did: within a unit in the last place (rsqrt, exp and summation order may differ
    in fp32), and bit for bit in at least 99% of the elements where the casts round to nearest. Rounding in
    another order (the weight multiplied before the cast, silu not rounded to the input dtype) differs in ~25%."""
    torch.testing.assert_close(got, want, **_ulps(got.dtype, 1))
    if not _truncates(got.dtype):
        assert (got == want).double().mean().item() >= 0.99


def _randn(*shape: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(DEVICE, dtype)


def _hf_rms_norm(h: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' ``LlamaRMSNorm.forward`` (importing transformers takes seconds): the cast before the weight."""
    x = h.to(torch.float32)
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(h.dtype)


def _check_add_rms_norm(rows: int, hidden: int, dtype: torch.dtype, with_delta: bool) -> None:
    h = _randn(rows, hidden, dtype=dtype, seed=hidden + rows) * 3
    delta = _randn(rows, hidden, dtype=dtype, seed=1) if with_delta else None
    weight = _randn(hidden, dtype=dtype, seed=2)
    want_h = h.clone()
    if delta is not None:
        want_h.add_(delta)  # the unfused torch code
    want = F.rms_norm(want_h, (hidden,), weight, EPS)
    out = torch.full_like(h, float("nan"))
    tn.add_rms_norm(h, delta, weight, EPS, out)
    torch.testing.assert_close(h, want_h, **_ulps(dtype, 0))  # updated in place, rounded as torch rounds it
    torch.testing.assert_close(out, want, **TOL[dtype])
    if dtype != torch.float32:  # HF's order (cast, then weight) on h as stored: only rsqrt and summation order differ
        _assert_rounded_like(out, _hf_rms_norm(h, weight, EPS))


@in_process
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("with_delta", [False, True])
@pytest.mark.parametrize(("rows", "hidden"), [(1, 96), (7, 200)])
def test_add_rms_norm_matches_torch(rows: int, hidden: int, dtype: torch.dtype, with_delta: bool):
    _check_add_rms_norm(rows, hidden, dtype, with_delta)


@in_process
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_rms_norm_walks_a_long_row_in_chunks(monkeypatch, dtype: torch.dtype):
    """A row longer than ``MAX_NORM_BLOCK`` takes the two-pass loop: 200 columns in 64-wide chunks, a ragged last."""
    monkeypatch.setattr(tn, "MAX_NORM_BLOCK", 64)
    _check_add_rms_norm(3, 200, dtype, with_delta=True)


@in_process
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("rows", "inter", "block"), [(1, 96, tn.SILU_BLOCK), (7, 200, tn.SILU_BLOCK), (7, 200, 64)])
def test_silu_mul_matches_torch(monkeypatch, rows: int, inter: int, block: int, dtype: torch.dtype):
    """Including several column tiles per row (block 64: four, the last ragged) and large |gate| (no overflow)."""
    monkeypatch.setattr(tn, "SILU_BLOCK", block)
    gu = _randn(rows, 2 * inter, dtype=dtype, seed=inter + rows) * 4
    gu[0, :4] = torch.tensor([-100.0, 100.0, -30.0, 0.0], dtype=dtype)
    g, u = gu.chunk(2, dim=-1)
    want = F.silu(g) * u
    out = torch.full((rows, inter), float("nan"), dtype=dtype, device=DEVICE)
    tn.silu_mul(gu, out)
    if dtype == torch.float32:
        torch.testing.assert_close(out, want, **TOL[dtype])
    else:
        _assert_rounded_like(out, want)


@in_process
def test_shape_mismatch_is_refused():
    h = torch.zeros(2, 96)
    with pytest.raises(ValueError, match="add_rms_norm"):
        tn.add_rms_norm(h, torch.zeros(2, 95), torch.ones(96), EPS, torch.empty_like(h))
    with pytest.raises(ValueError, match="silu_mul"):
        tn.silu_mul(torch.zeros(2, 96), torch.empty(2, 96))


@in_process
def test_supported():
    t = torch.zeros(4, 8, device=DEVICE)
    assert tn.supported(t) and tn.supported(t.half()) and tn.supported(t.bfloat16())
    assert not tn.supported(t.t())  # not contiguous
    assert not tn.supported(t.to(torch.int32))


@pytest.mark.skipif(IN_PROCESS or ON_CUDA, reason="the kernels run in this process")
def test_the_module_in_a_fresh_interpreter():
    """This session imported triton before TRITON_INTERPRET=1 could be set: run the module where it can be."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "not sm90",
                           str(Path(__file__))], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and " passed" in done.stdout, done.stdout[-4000:] + done.stderr[-2000:]


