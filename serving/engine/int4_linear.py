"""Weight-only 4-bit linear layers on CPU: a GPTQ/AWQ snapshot served from its 4-bit codes, not from fp32 copies.

Why: a decode step reads every weight once, so at small batch its time is weight bytes over memory bandwidth.
A 4-bit snapshot holds an eighth of the fp32 bytes; serving it from dequantized fp32 weights (what
``serving.engine.dequantize`` does for the HF-free path) throws that away and decodes at fp32 speed, with fp32
memory. torch's own int4 CPU matmul needs bf16 activations to be fast (its fp32 variant is a reference loop),
which would change every activation's precision. This kernel keeps activations and accumulation in fp32 and
expands the 4-bit codes to fp32 in registers, so it reads 4.25 bits per weight and computes what the
dequantized fp32 layer computes (up to summation order).

Storage (built once at load by ``Int4Linear.from_dense``): output rows in tiles of 16; for each tile and each
pair of input columns (k, k+1) 16 bytes, byte j holding row j's code for k in its low nibble and for k+1 in its
high nibble. Per tile and group of ``group_size`` input columns: 16 fp32 scales ``s`` and 16 fp32 offsets
``s * z`` (asymmetric zero point), so ``w[n, k] = s[n, g] * q[n, k] - (s * z)[n, g]`` and

    y[m, n] = sum_g s[n, g] * (sum_{k in g} x[m, k] * q[n, k]) - (s * z)[n, g] * (sum_{k in g} x[m, k]).

Two ways through the same storage, picked per call by the number of activation rows M:
- small M (decode): each tile's bytes are walked once per chunk of up to 8 rows, 32 codes expanded per 16-byte
  load in registers, the raw dot products summed per group and scaled at the group's end (the group sums of ``x``
  are computed once per call);
- larger M (batched decode, prefill chunks): a block of tiles times one group of columns is decoded into an
  L1-resident fp32 buffer once per call and a register-blocked GEMM runs every row over it, so decoding is paid
  once per weight and the FMA units set the pace (within a few percent of oneDNN's fp32 GEMM on the same shapes,
  where expanding the whole layer to fp32 first and calling torch's matmul was 1.2-3x slower).
Tiles (or blocks of tiles) are split over threads.

The codes are recovered from the checkpoint's own dequantized weights and scales (``serving.engine.dequantize``
hands both over), and the recovery is checked: a weight that is not exactly on its group's 4-bit grid (act-order
checkpoints whose groups are not contiguous, other bit widths) makes ``from_dense`` return None and that layer
stays dense fp32. The C++ is ``csrc/int4_linear.cpp``, compiled by ``cpp_build.build`` (``-march=native``);
without a compiler every layer stays dense.
"""

from __future__ import annotations

import functools
from types import ModuleType

import torch

from artifacts.common.host import cpuinfo_field
from serving.engine import cpp_build

TILE = 16  # output rows per tile: one 16-lane vector of fp32
# Up to this many activation rows the codes are decoded in registers for each chunk of rows; above it, once per
# call into an L1 buffer that a register-blocked GEMM reads (the crossover measured in benchmarks/NOTEBOOK.md).
DEFAULT_SMALL_ROWS = 8
# Without AVX-512, the register path serves up to this many rows, and expanded codes with torch's GEMM above it
# (K 256, N 1024 on AVX2: 64 rows 1.3 ms in registers against 1.7 ms expanded; 752 rows 6.7 ms expanded)
NO_AVX512_SMALL_ROWS = 64

@functools.cache
def kernel_gemm_is_fast() -> bool:
    """Whether the kernel's own GEMM (more than ``small_rows`` activation rows: prefill, batched decode) is the fast
    way here. It is register-blocked for AVX-512's 32 vector registers; on an AVX2 host (AMD EPYC, 2026-11-28) it
    ran 25x slower than fp32 GEMM (M = 752, K = 256, N = 1024: 186 ms against 7.4 ms), and a 4-bit snapshot's
    prompts took 10x as long as fp32's. There, the codes are expanded to fp32 for the call and torch's GEMM runs
    (the expansion is N x K element-wise work, small beside M x N x K); decode (few rows) keeps the kernel."""
    return "avx512f" in cpuinfo_field("flags").split()


_module: ModuleType | None = None
_tried = False


def load() -> ModuleType | None:
    """The compiled kernel (``int4_linear``), or None when it cannot be built here."""
    global _module, _tried
    if not _tried:
        _tried = True
        _module = cpp_build.build("llm_lifecycle_int4", cpp_build.CSRC / "int4_linear.cpp")
    return _module


class Int4Linear:
    """``y = x @ w.T + b`` for a weight held as 4-bit codes (see the module docstring); fp32 in and out."""

    __slots__ = ("codes", "scales", "offsets", "bias", "out_features", "in_features", "kernels", "small_rows",
                 "gemm_in_kernel")

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor, bias: torch.Tensor | None,
                 kernels: ModuleType, small_rows: int = DEFAULT_SMALL_ROWS) -> None:
        self.codes, self.scales, self.offsets = codes, scales, offsets
        self.bias = None if bias is None else bias.float().contiguous()
        self.out_features = codes.shape[0] * TILE
        self.in_features = codes.shape[1] * 2
        self.small_rows = small_rows
        self.gemm_in_kernel = kernel_gemm_is_fast()  # the host's way for many rows, decided once per layer
        self.kernels = kernels

    @classmethod
    def from_dense(cls, weight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None,
                   kernels: ModuleType | None = None) -> Int4Linear | None:
        """Pack ``weight`` [N, K] (fp32 values on a 4-bit grid) given its per-group ``scales`` [N, G].

        Returns None (the caller keeps the dense weight) when the kernels are unavailable, the shape does not
        tile (N % 16, K % G, odd group size), or some weight is not exactly ``scale * integer`` with at most
        16 levels per group, which is what recovering the codes requires.
        """
        kernels = kernels if kernels is not None else load()
        if kernels is None or weight.dim() != 2 or scales.dim() != 2:
            return None
        n, k = weight.shape
        g = scales.shape[1]
        if scales.shape[0] != n or n % TILE or g == 0 or k % g or (k // g) % 2:
            return None
        gs = k // g
        w = weight.detach().float().view(n, g, gs)
        s = scales.detach().float().view(n, g, 1)
        if not torch.all(s > 0):
            return None
        ratio = w / s
        level = ratio.round()
        if not torch.allclose(ratio, level, rtol=0, atol=1e-2):
            return None  # not on the 4-bit grid these scales define
        low = level.amin(dim=2, keepdim=True)
        q = level - low  # codes from 0; the zero point is -low
        if q.amax() > 15:
            return None
        offsets = (s * -low).view(n, g)  # s * z with z = -low: w = s * q - s * z
        q = q.to(torch.uint8).view(n // TILE, TILE, k // 2, 2)
        packed = (q[..., 0] | (q[..., 1] << 4)).permute(0, 2, 1).contiguous()  # [N/16, K/2, 16]
        tile = lambda t: t.view(n // TILE, TILE, g).permute(0, 2, 1).contiguous()  # noqa: E731 [N/16, G, 16]
        return cls(packed, tile(s.view(n, g)), tile(offsets), bias, kernels)

    @property
    def nbytes(self) -> int:
        """Bytes the weight takes in memory (codes, scales, offsets)."""
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scales, self.offsets))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        small_rows = self.small_rows
        if not self.gemm_in_kernel:  # the register path up to where expanding the codes once costs less
            if x.shape[0] > NO_AVX512_SMALL_ROWS:
                return torch.nn.functional.linear(x, self.dense(), self.bias)
            small_rows = max(small_rows, NO_AVX512_SMALL_ROWS)
        out = torch.empty(x.shape[0], self.out_features, dtype=torch.float32)
        self.kernels.int4_linear(x, self.codes, self.scales, self.offsets, self.bias, out, small_rows)
        return out

    def dense(self) -> torch.Tensor:
        """The fp32 weight [N, K] the codes stand for (``s * q - s * z``), expanded for this call only."""
        t, half, _ = self.codes.shape
        q = torch.stack((self.codes & 15, self.codes >> 4), dim=2).view(t, half * 2, TILE)  # [T, K, 16]
        groups = self.scales.shape[1]
        size = half * 2 // groups
        q = q.view(t, groups, size, TILE).float()
        w = q * self.scales[:, :, None, :] - self.offsets[:, :, None, :]  # [T, G, gs, 16]
        return w.permute(0, 3, 1, 2).reshape(t * TILE, half * 2)
