"""compact_llama.Linear (oneDNN-prepacked on CPU) computes what F.linear computes, for any row count."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from serving.engine.compact_llama import Linear


@pytest.mark.parametrize("bias", [False, True])
def test_linear_matches_f_linear(bias):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(96, 64, generator=g) * 0.05
    b = torch.randn(96, generator=g) if bias else None
    lin = Linear(w, b)
    assert lin.packed == (torch.backends.mkldnn.is_available())  # fp32 on CPU: the oneDNN path when present
    for rows in (0, 1, 3, 17, 130):
        x = torch.randn(rows, 64, generator=g)
        y = lin(x)
        assert y.shape == (rows, 96)
        torch.testing.assert_close(y, F.linear(x, w, b), rtol=1e-5, atol=1e-5)


def test_linear_falls_back_to_f_linear_for_fp16():
    w = torch.randn(8, 4).half()
    lin = Linear(w)
    assert not lin.packed and lin.weight is w
