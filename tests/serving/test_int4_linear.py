"""4-bit weight-only linear layers (serving/engine/int4_linear.py): codes recovered exactly from a weight on its
4-bit grid, both kernel paths (registers for few rows, the L1-buffered GEMM for many) equal to the fp32 matmul,
and weights that are not on a grid left dense."""

from __future__ import annotations

import pytest
import torch

from serving.engine import int4_linear
from serving.engine.int4_linear import Int4Linear

pytestmark = pytest.mark.skipif(int4_linear.load() is None, reason="no C++ compiler: the 4-bit kernels cannot build")


def on_grid(n: int, k: int, group: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight [n, k] whose every group of ``group`` input columns is scale * (code - zero), codes 0..15."""
    gen = torch.Generator().manual_seed(seed)
    g = k // group
    scales = torch.rand(n, g, generator=gen) * 0.02 + 1e-3
    zeros = torch.randint(0, 16, (n, g), generator=gen).float()
    codes = torch.randint(0, 16, (n, k), generator=gen).float()
    weight = (codes.view(n, g, group) - zeros[..., None]) * scales[..., None]
    return weight.view(n, k), scales


@pytest.mark.parametrize("n,k,group", [(48, 64, 32), (80, 128, 128), (512, 256, 64), (32, 96, 96)])
def test_codes_recover_the_weight_exactly(n, k, group):
    weight, scales = on_grid(n, k, group)
    layer = Int4Linear.from_dense(weight, scales)
    assert layer is not None
    # the identity's rows pick out the weight's columns one by one: x @ w.T = w.T, each entry one code's value
    assert torch.allclose(layer(torch.eye(k)).T, weight, rtol=0, atol=1e-6)
    assert layer.nbytes < weight.numel() * 4 / 4  # well under a quarter of the fp32 bytes


@pytest.mark.parametrize("rows", [1, 3, 8, 9, 13, 64, 100])
@pytest.mark.parametrize("n,k,group,bias", [(80, 128, 32, True), (512, 256, 64, False), (48, 64, 64, True)])
def test_matmul_equals_fp32_on_every_path(rows, n, k, group, bias):
    """Rows up to ``small_rows`` decode in registers, above it through the L1 buffer; N = 80 and 48 leave a
    remainder of tiles past the GEMM's 4-tile blocks, 13 and 100 rows a remainder of its row chunks."""
    weight, scales = on_grid(n, k, group, seed=rows)
    b = torch.randn(n) if bias else None
    layer = Int4Linear.from_dense(weight, scales, b)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(1))
    expected = torch.nn.functional.linear(x, weight, b)
    out = layer(x)
    assert out.shape == (rows, n)
    assert torch.allclose(out, expected, rtol=1e-4, atol=1e-4), (out - expected).abs().max()


@pytest.mark.parametrize("kernel_gemm", [True, False], ids=["avx512-kernel-gemm", "expanded-codes"])
def test_every_path_agrees_on_the_same_rows(monkeypatch, kernel_gemm):
    """Many rows go through the kernel's own GEMM where it is fast (AVX-512 hosts), else through the codes expanded
    to fp32 and torch's GEMM: both equal the register path and the fp32 matmul, whatever host runs the test."""
    monkeypatch.setattr(int4_linear, "kernel_gemm_is_fast", lambda: kernel_gemm)
    weight, scales = on_grid(256, 512, 128, seed=7)
    layer = Int4Linear.from_dense(weight, scales)
    x = torch.randn(100, 512)
    layer.small_rows = 10 ** 9  # every row in registers
    registers = layer(x)
    layer.small_rows = 0  # the many-rows path of this host kind
    many = layer(x)
    assert torch.allclose(registers, many, rtol=1e-5, atol=1e-5)
    assert torch.allclose(many, x @ weight.T, rtol=1e-4, atol=1e-4)


def test_the_expanded_codes_are_the_weight():
    weight, scales = on_grid(80, 128, 32, seed=3)
    assert torch.allclose(Int4Linear.from_dense(weight, scales).dense(), weight, rtol=0, atol=1e-6)


def test_weights_off_a_4bit_grid_stay_dense():
    weight, scales = on_grid(64, 64, 32)
    assert Int4Linear.from_dense(weight + 0.3 * scales.repeat_interleave(32, dim=1), scales) is None  # between levels
    wide = weight.clone()
    wide[0, 0] = weight[0, :32].min() - 20 * scales[0, 0]  # 16 levels cannot span this group any more
    assert Int4Linear.from_dense(wide, scales) is None
    assert Int4Linear.from_dense(weight[:24], scales[:24]) is None  # 24 rows do not tile by 16
    assert Int4Linear.from_dense(weight, -scales) is None  # a scale must be positive
    assert Int4Linear.from_dense(weight, scales[:, :1]) is None  # scales for other groups than the weight's grid
