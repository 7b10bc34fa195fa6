"""The Triton dense GEMV (serving/engine/triton_gemv.py) equals ``x @ W.T (+ b)``: ragged N and K, bias or not,
fp32 and fp16 activations (bf16 on a GPU), and a weight that is a view of a fused projection's rows.

Without a GPU the kernel runs in Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1 before anything
imports triton); with one, the same tests run on it.
"""

from __future__ import annotations

import pytest
import torch

from serving.engine.triton_gemv import dense_gemv, gemv_block_n
from tests.serving.test_triton_int4 import assert_matches

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,k,bias", [(40, 96, False), (33, 700, True), (8, 1024, True), (130, 512, False)])
def test_the_gemv_equals_the_matmul(dtype, n, k, bias):
    """K = 96 and 700 leave a partial 512-column step (masked); N = 33 and 130 a partial block of rows."""
    gen = torch.Generator().manual_seed(n * k)
    w = torch.randn(n, k, generator=gen).to(dtype).to(DEVICE)
    x = torch.randn(1, k, generator=gen).to(dtype).to(DEVICE)
    b = torch.randn(n, generator=gen).to(dtype).to(DEVICE) if bias else None
    assert_matches(dense_gemv(x, w, b), x, w, b)


def test_rows_of_a_fused_projection_and_two_activation_rows():
    """A slice of a fused weight's rows is a strided view (row stride K): read in place, no copy."""
    gen = torch.Generator().manual_seed(3)
    fused = torch.randn(96, 256, generator=gen).to(DEVICE)
    part = fused[32:80]
    x = torch.randn(2, 256, generator=gen).to(DEVICE)
    assert_matches(dense_gemv(x, part), x, part, None)
    with pytest.raises(ValueError, match="rows must be contiguous"):
        dense_gemv(x, torch.randn(256, 48, generator=gen).to(DEVICE).T)  # a transposed weight [48, 256]
    with pytest.raises(ValueError, match=r"expected x \[M, K\]"):
        dense_gemv(x[:, :100], part)


def test_the_row_block_keeps_two_programs_on_every_sm():
    assert gemv_block_n(2048, 1, 132) == 4  # 8 rows a program would give 256 programs, under two a SM
    assert gemv_block_n(32000, 1, 132) == 16  # the head: 2,000 programs at the widest block
    assert gemv_block_n(512, 1, 132) == 1  # the K/V heads: one row a program, 512 programs
    assert gemv_block_n(64, 1, 132) == 1


def test_a_projection_on_the_triton_gemv_runs_it_for_one_row_and_cublas_for_more():
    """``DenseLinear``'s ``triton-gemv`` backend (chosen on CUDA by LLM_LIFECYCLE_GPU_GEMV=triton): one activation
    row, a batch-1 decode, goes to the kernel; a prefill chunk or a batch stays on F.linear. Its weight stays a plain
    tensor, so the HF projections keep slices of it."""
    from serving.engine import triton_gemv
    from serving.engine.compact_llama import DenseLinear

    gen = torch.Generator().manual_seed(5)
    w, b = torch.randn(24, 64, generator=gen).to(DEVICE), torch.randn(24, generator=gen).to(DEVICE)
    linear = DenseLinear(w, b, backend="triton-gemv")
    assert not linear.packed
    calls = []
    real = triton_gemv.dense_gemv
    try:  # a wrapper that counts (the kernel itself runs): which calls reach it
        triton_gemv.dense_gemv = lambda *a: calls.append(a[0].shape) or real(*a)
        one, many = torch.randn(1, 1, 64, generator=gen).to(DEVICE), torch.randn(3, 64, generator=gen).to(DEVICE)
        assert_matches(linear(one).view(1, 24), one.view(1, 64), w, b)
        assert_matches(linear(many), many, w, b)
    finally:
        triton_gemv.dense_gemv = real
    assert calls == [(1, 64)] and linear(one).shape == (1, 1, 24)
