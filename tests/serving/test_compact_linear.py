"""compact_llama.DenseLinear computes what F.linear computes, for any row count, with each CPU GEMM: MKL's packed
sgemm (the choice on Intel CPUs), our tiled kernel (on other CPUs with AVX2 + FMA), oneDNN's packed inner product
and plain F.linear; and the choice follows the CPU and the override."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from serving.engine.compact_llama import DenseLinear
from serving.engine.linear_backend import GEMM_ENV, cpu_vendor, mkl_packed_works, tiled_kernels

BACKENDS = [pytest.param("mkl", marks=pytest.mark.skipif(not mkl_packed_works(), reason="torch without MKL")),
            pytest.param("onednn", marks=pytest.mark.skipif(not torch.backends.mkldnn.is_available(),
                                                            reason="torch without oneDNN")),
            pytest.param("tiled", marks=pytest.mark.skipif(tiled_kernels() is None, reason="no AVX2 + FMA kernels")),
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


@pytest.mark.skipif(tiled_kernels() is None, reason="no AVX2 + FMA kernels")
@pytest.mark.parametrize("rows", [1, 2, 6, 7, 95, 97, 300])
@pytest.mark.parametrize("out_features, in_features", [(8, 3), (40, 33), (100, 513), (17, 1), (1, 5), (272, 64)])
def test_tiled_linear_at_every_edge(rows, out_features, in_features):
    """The tiled kernel's edges: output columns not a multiple of its 16-column pairs (the padded tail goes through a
    scratch block), one row (four tiles at once, the last group of two), row blocks of 6 and 96 with remainders,
    inputs longer than one K block of 256, and leading dimensions folded into rows."""
    g = torch.Generator().manual_seed(rows * 1000 + out_features)
    w = torch.randn(out_features, in_features, generator=g)
    lin = DenseLinear(w, None, "tiled")
    x = torch.randn(rows, in_features, generator=g)
    torch.testing.assert_close(lin(x), F.linear(x, w), rtol=1e-4, atol=1e-4 * in_features ** 0.5)
    x3 = torch.randn(2, rows, in_features, generator=g)
    torch.testing.assert_close(lin(x3), F.linear(x3, w), rtol=1e-4, atol=1e-4 * in_features ** 0.5)


def test_the_gemm_library_follows_the_cpu_and_the_override(monkeypatch):
    w = torch.randn(16, 8)
    monkeypatch.delenv(GEMM_ENV, raising=False)
    intel = cpu_vendor() == "GenuineIntel" and mkl_packed_works()
    onednn = "onednn" if torch.backends.mkldnn.is_available() else "plain"
    automatic = "mkl" if intel else "tiled" if tiled_kernels() is not None else onednn
    assert DenseLinear(w).backend == automatic
    monkeypatch.setenv(GEMM_ENV, "onednn")
    assert DenseLinear(w).backend == onednn
    monkeypatch.setenv(GEMM_ENV, "tiled")  # an override that cannot run here falls back to the automatic choice
    assert DenseLinear(w).backend == ("tiled" if tiled_kernels() is not None else automatic)
    monkeypatch.setenv(GEMM_ENV, "mkl")
    assert DenseLinear(w).backend == ("mkl" if mkl_packed_works() else automatic)
    assert DenseLinear(w.bfloat16()).backend != "tiled"  # the kernel is fp32: other dtypes keep oneDNN or F.linear
    monkeypatch.setenv(GEMM_ENV, "cublas")
    with pytest.raises(ValueError, match=GEMM_ENV):
        DenseLinear(w)


def test_linear_falls_back_to_f_linear_for_fp16():
    w = torch.randn(8, 4).half()
    lin = DenseLinear(w)
    assert not lin.packed and lin.weight is w
