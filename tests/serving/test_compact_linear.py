"""compact_llama.DenseLinear computes what F.linear computes, for any row count, with each CPU GEMM: MKL's packed
sgemm (the choice on Intel CPUs), our tiled kernel (on other CPUs with AVX2 + FMA), oneDNN's packed inner product
and plain F.linear; and the choice follows the CPU and the override."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from artifacts.common.host import cpuinfo_field
from serving.engine import cpp_build
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
@pytest.mark.parametrize("rows", [1, 2, 6, 7, 13, 16, 23, 95, 97, 300])
@pytest.mark.parametrize("out_features, in_features", [(8, 3), (40, 33), (100, 513), (17, 1), (1, 5), (272, 64)])
def test_tiled_linear_at_every_edge(rows, out_features, in_features):
    """The tiled kernel's edges: output columns not a multiple of its tile pairs (the padded tail goes through a
    scratch block), one row (four tiles at once, the last group of two), register blocks of up to 6 rows (AVX2) or
    12 (AVX-512) with the rows split into equal passes (13, 16, 23), panels from 24 rows and work items of 96, with
    remainders, inputs longer than one K block of 256, and leading dimensions folded into rows."""
    g = torch.Generator().manual_seed(rows * 1000 + out_features)
    w = torch.randn(out_features, in_features, generator=g)
    lin = DenseLinear(w, None, "tiled")
    x = torch.randn(rows, in_features, generator=g)
    torch.testing.assert_close(lin(x), F.linear(x, w), rtol=1e-4, atol=1e-4 * in_features ** 0.5)
    x3 = torch.randn(2, rows, in_features, generator=g)
    torch.testing.assert_close(lin(x3), F.linear(x3, w), rtol=1e-4, atol=1e-4 * in_features ** 0.5)



def tiled_at_the_edges() -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(x, w, the tiled GEMM's x @ w.T) over row counts and shapes at the kernel's edges, from a fixed seed: the
    same inputs in every process, whichever vector width its kernels were built for."""
    g = torch.Generator().manual_seed(0)
    out = []
    for rows in (1, 2, 6, 7, 13, 16, 95, 97, 300):
        for n, k in ((8, 3), (40, 33), (100, 513), (17, 1), (272, 64)):
            w, x = torch.randn(n, k, generator=g), torch.randn(rows, k, generator=g)
            out.append((x, w, DenseLinear(w, None, "tiled")(x)))
    return out


EDGES_IN_A_SUBPROCESS = """
import sys, torch, torch.nn.functional as F
from serving.engine.linear_backend import tiled_kernels
from tests.serving.test_compact_linear import tiled_at_the_edges
print("lanes", tiled_kernels().tiled_pack(torch.randn(3, 2)).shape[2])
cases = tiled_at_the_edges()
for x, w, y in cases:
    torch.testing.assert_close(y, F.linear(x, w), rtol=1e-4, atol=1e-4 * x.shape[1] ** 0.5)
torch.save([y for _, _, y in cases], sys.argv[1])
print("ok")
"""


@pytest.mark.skipif(tiled_kernels() is None or "avx512f" not in cpuinfo_field("flags").split(),
                    reason="the native build is the AVX2 one here (the tests above cover it)")
def test_the_avx2_tiles_on_an_avx512_host_give_the_same_bits(tmp_path):
    """The tiled GEMM has two vector widths in one source (16-lane tiles with AVX-512, 8-lane with AVX2); the tests
    above run the host's. Here the kernels are built without AVX-512 (``LLM_LIFECYCLE_CPU_KERNELS_FLAGS``, a real
    compile in a fresh process) and held to F.linear at the same edges, so the AVX2 hosts' path stays checked from
    an AVX-512 one; and their outputs equal this process's 16-lane ones to the bit (each output sums its k in the
    same order on both widths), so the width cannot move what a model computes from one host to the next."""
    env = {**os.environ, cpp_build.FLAGS_ENV: "-mno-avx512f"}
    saved = tmp_path / "avx2.pt"
    done = subprocess.run([sys.executable, "-c", EDGES_IN_A_SUBPROCESS, str(saved)], env=env, capture_output=True,
                          text=True, timeout=600, cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["lanes", "8", "ok"]
    assert tiled_kernels().tiled_pack(torch.randn(3, 2)).shape[2] == 16  # this process: the native AVX-512 tiles
    avx2 = torch.load(saved)
    native = [y for _, _, y in tiled_at_the_edges()]
    assert len(avx2) == len(native) == 45
    assert all(torch.equal(a, b) for a, b in zip(avx2, native, strict=True))


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
