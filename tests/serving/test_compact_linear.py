"""compact_llama.DenseLinear computes what F.linear computes, for any row count, with each CPU GEMM library:
MKL's packed sgemm (the choice on Intel CPUs), oneDNN's packed inner product (elsewhere) and plain F.linear."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from serving.engine.compact_llama import DenseLinear
from serving.engine.linear_backend import GEMM_ENV, cpu_vendor, mkl_packed_works

BACKENDS = [pytest.param("mkl", marks=pytest.mark.skipif(not mkl_packed_works(), reason="torch without MKL")),
            pytest.param("onednn", marks=pytest.mark.skipif(not torch.backends.mkldnn.is_available(),
                                                            reason="torch without oneDNN")),
            "plain"]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("bias", [False, True])
def test_linear_matches_f_linear(bias, backend):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(96, 64, generator=g) * 0.05
    b = torch.randn(96, generator=g) if bias else None
    lin = DenseLinear(w, b, backend)
    assert lin.backend == backend and lin.packed == (backend != "plain") and lin.nbytes == w.numel() * 4
    for rows in (0, 1, 3, 17, 64, 130, 600):  # a packed MKL weight serves every row count, not only 64
        x = torch.randn(rows, 64, generator=g)
        y = lin(x)
        assert y.shape == (rows, 96)
        torch.testing.assert_close(y, F.linear(x, w, b), rtol=1e-5, atol=1e-5)


def test_the_gemm_library_follows_the_cpu_and_the_override(monkeypatch):
    w = torch.randn(16, 8)
    monkeypatch.delenv(GEMM_ENV, raising=False)
    intel = cpu_vendor() == "GenuineIntel" and mkl_packed_works()
    assert DenseLinear(w).backend == ("mkl" if intel else "onednn" if torch.backends.mkldnn.is_available() else "plain")
    monkeypatch.setenv(GEMM_ENV, "onednn")
    assert DenseLinear(w).backend != "mkl"
    monkeypatch.setenv(GEMM_ENV, "cublas")
    with pytest.raises(ValueError, match=GEMM_ENV):
        DenseLinear(w)


def test_linear_falls_back_to_f_linear_for_fp16():
    w = torch.randn(8, 4).half()
    lin = DenseLinear(w)
    assert not lin.packed and lin.weight is w
