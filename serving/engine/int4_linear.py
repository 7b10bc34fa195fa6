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
stays dense fp32. Built with ``cpu_kernels.build`` (C++, ``-march=native``); without a compiler every layer
stays dense.
"""

from __future__ import annotations

import logging
from types import ModuleType

import torch

from serving.engine import cpu_kernels

log = logging.getLogger(__name__)

TILE = 16  # output rows per tile: one 16-lane vector of fp32
# Up to this many activation rows the codes are decoded in registers for each chunk of rows; above it, once per
# call into an L1 buffer that a register-blocked GEMM reads (the crossover measured in benchmarks/RESULTS.md).
DEFAULT_SMALL_ROWS = 8

CPP_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

// One tile (16 output rows) for MC activation rows starting at x: out[m * ldo + 0..15].
// codes: [K/2][16] bytes of this tile; scales/offsets: [G][16]; xsum: [MC][G] group sums of x.
// The 16 codes of one column pair as fp32 (k: low nibbles, k+1: high nibbles); `Acc` sums code * x for one
// activation row, the two columns in separate registers so consecutive FMAs do not wait on each other.
#if defined(__AVX512F__)
constexpr int ROWS = 8;  // activation rows per pass: 16 accumulators of 32 registers
struct Pair {
  __m512 lo, hi;
  explicit Pair(const uint8_t* p) {
    const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    lo = _mm512_cvtepi32_ps(_mm512_and_si512(b, _mm512_set1_epi32(15)));
    hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4));
  }
  // s * code - o for both columns, stored as two rows of 16 floats
  void expand(const float* s, const float* o, float* out_lo, float* out_hi) const {
    const __m512 sv = _mm512_loadu_ps(s), ov = _mm512_loadu_ps(o);
    _mm512_storeu_ps(out_lo, _mm512_fmsub_ps(lo, sv, ov));
    _mm512_storeu_ps(out_hi, _mm512_fmsub_ps(hi, sv, ov));
  }
};
struct Acc {
  __m512 a = _mm512_setzero_ps(), b = _mm512_setzero_ps();
  void fma(const Pair& w, float x0, float x1) {
    a = _mm512_fmadd_ps(w.lo, _mm512_set1_ps(x0), a);
    b = _mm512_fmadd_ps(w.hi, _mm512_set1_ps(x1), b);
  }
  void to(float* out) const { _mm512_storeu_ps(out, _mm512_add_ps(a, b)); }
};
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int ROWS = 3;  // 12 accumulators + 4 code registers of 16
struct Pair {
  __m256 lo0, hi0, lo1, hi1;  // rows 0-7, rows 8-15
  explicit Pair(const uint8_t* p) {
    const __m256i m = _mm256_set1_epi32(15);
    const __m256i b0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    const __m256i b1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8)));
    lo0 = _mm256_cvtepi32_ps(_mm256_and_si256(b0, m));
    hi0 = _mm256_cvtepi32_ps(_mm256_srli_epi32(b0, 4));
    lo1 = _mm256_cvtepi32_ps(_mm256_and_si256(b1, m));
    hi1 = _mm256_cvtepi32_ps(_mm256_srli_epi32(b1, 4));
  }
  void expand(const float* s, const float* o, float* out_lo, float* out_hi) const {
    const __m256 s0 = _mm256_loadu_ps(s), s1 = _mm256_loadu_ps(s + 8);
    const __m256 o0 = _mm256_loadu_ps(o), o1 = _mm256_loadu_ps(o + 8);
    _mm256_storeu_ps(out_lo, _mm256_fmsub_ps(lo0, s0, o0));
    _mm256_storeu_ps(out_lo + 8, _mm256_fmsub_ps(lo1, s1, o1));
    _mm256_storeu_ps(out_hi, _mm256_fmsub_ps(hi0, s0, o0));
    _mm256_storeu_ps(out_hi + 8, _mm256_fmsub_ps(hi1, s1, o1));
  }
};
struct Acc {
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), b0 = _mm256_setzero_ps(), b1 = _mm256_setzero_ps();
  void fma(const Pair& w, float x0, float x1) {
    const __m256 v0 = _mm256_set1_ps(x0), v1 = _mm256_set1_ps(x1);
    a0 = _mm256_fmadd_ps(w.lo0, v0, a0);
    a1 = _mm256_fmadd_ps(w.lo1, v0, a1);
    b0 = _mm256_fmadd_ps(w.hi0, v1, b0);
    b1 = _mm256_fmadd_ps(w.hi1, v1, b1);
  }
  void to(float* out) const {
    _mm256_storeu_ps(out, _mm256_add_ps(a0, b0));
    _mm256_storeu_ps(out + 8, _mm256_add_ps(a1, b1));
  }
};
#else
constexpr int ROWS = 4;
struct Pair {
  float lo[16], hi[16];
  explicit Pair(const uint8_t* p) {
    for (int j = 0; j < 16; ++j) { lo[j] = static_cast<float>(p[j] & 15); hi[j] = static_cast<float>(p[j] >> 4); }
  }
  void expand(const float* s, const float* o, float* out_lo, float* out_hi) const {
    for (int j = 0; j < 16; ++j) { out_lo[j] = lo[j] * s[j] - o[j]; out_hi[j] = hi[j] * s[j] - o[j]; }
  }
};
struct Acc {
  float v[16] = {};
  void fma(const Pair& w, float x0, float x1) {
    for (int j = 0; j < 16; ++j) v[j] += w.lo[j] * x0 + w.hi[j] * x1;
  }
  void to(float* out) const { std::memcpy(out, v, sizeof v); }
};
#endif

// One tile (16 output rows) for MC activation rows starting at x: out[m * ldo + 0..15].
// codes: [K/2][16] bytes of this tile; scales/offsets: [G][16]; xsum: [MC][G] group sums of x.
// Per group the raw dot products are summed in registers, then scaled into the totals (kept in `total`).
template <int MC>
void tile_rows(const float* x, int64_t ldx, const uint8_t* codes, const float* scales, const float* offsets,
               const float* xsum, int64_t G, int64_t gs, float* out, int64_t ldo, const float* bias) {
  alignas(64) float total[MC][16] = {};
  alignas(64) float part[16];
  const int64_t pairs = gs / 2;
  for (int64_t g = 0; g < G; ++g) {
    Acc acc[MC];
    const uint8_t* c = codes + g * pairs * 16;
    const float* xg = x + g * gs;
    for (int64_t p = 0; p < pairs; ++p) {
      const Pair w(c + p * 16);
      for (int m = 0; m < MC; ++m) acc[m].fma(w, xg[m * ldx + 2 * p], xg[m * ldx + 2 * p + 1]);
    }
    const float* s = scales + g * 16;
    const float* o = offsets + g * 16;
    for (int m = 0; m < MC; ++m) {
      acc[m].to(part);
      const float xs = xsum[m * G + g];
      for (int j = 0; j < 16; ++j) total[m][j] += s[j] * part[j] - o[j] * xs;
    }
  }
  for (int m = 0; m < MC; ++m)
    for (int j = 0; j < 16; ++j) out[m * ldo + j] = total[m][j] + (bias ? bias[j] : 0.f);
}

template <int MC>
void tile_rows_dispatch(int64_t mc, const float* x, int64_t ldx, const uint8_t* codes, const float* scales,
                        const float* offsets, const float* xsum, int64_t G, int64_t gs, float* out, int64_t ldo,
                        const float* bias) {
  if (mc == MC) {
    tile_rows<MC>(x, ldx, codes, scales, offsets, xsum, G, gs, out, ldo, bias);
  } else if constexpr (MC > 1) {
    tile_rows_dispatch<MC - 1>(mc, x, ldx, codes, scales, offsets, xsum, G, gs, out, ldo, bias);
  }
}


// Larger batches: decode a block of NT tiles x one group of columns into an L1-resident fp32 buffer once, then run
// every activation row over it MC rows at a time, NT vectors per broadcast (a register-blocked GEMM), so decoding
// is paid once per weight per call and the FMA units, not the decoding, set the pace.
typedef float v16 __attribute__((vector_size(64)));
inline v16 ld16(const float* p) { v16 v; std::memcpy(&v, p, sizeof v); return v; }
inline void st16(float* p, v16 v) { std::memcpy(p, &v, sizeof v); }

#if defined(__AVX512F__)
constexpr int GEMM_NT = 4, GEMM_MC = 6;  // 24 accumulators + 4 weight vectors of 32 registers
#else
constexpr int GEMM_NT = 2, GEMM_MC = 2;  // 16 ymm registers: 8 accumulators + 4 weight halves
#endif

template <int MC, int NT>
void gemm_block(const float* x, int64_t ldx, const float* w, int64_t kstride, int64_t nstride, int64_t len,
                float* out, int64_t ldo, bool first) {
  v16 acc[MC][NT];
  for (int m = 0; m < MC; ++m)
    for (int n = 0; n < NT; ++n) acc[m][n] = first ? (v16){} : ld16(out + m * ldo + n * 16);
  for (int64_t k = 0; k < len; ++k) {
    v16 wv[NT];
    for (int n = 0; n < NT; ++n) wv[n] = ld16(w + k * kstride + n * nstride);
    for (int m = 0; m < MC; ++m) {
      const float xv = x[m * ldx + k];
      for (int n = 0; n < NT; ++n) acc[m][n] += wv[n] * xv;
    }
  }
  for (int m = 0; m < MC; ++m)
    for (int n = 0; n < NT; ++n) st16(out + m * ldo + n * 16, acc[m][n]);
}

template <int MC, int NT>
void gemm_rows_dispatch(int64_t mc, const float* x, int64_t ldx, const float* w, int64_t kstride, int64_t nstride,
                        int64_t len, float* out, int64_t ldo, bool first) {
  if (mc == MC) {
    gemm_block<MC, NT>(x, ldx, w, kstride, nstride, len, out, ldo, first);
  } else if constexpr (MC > 1) {
    gemm_rows_dispatch<MC - 1, NT>(mc, x, ldx, w, kstride, nstride, len, out, ldo, first);
  }
}

// Tiles [t0, t0 + NT) for all M rows.
template <int NT>
void gemm_tiles(int64_t t0, int64_t M, int64_t K, int64_t G, const float* xp, const uint8_t* cp, const float* sp,
                const float* op, float* yp, int64_t N, float* wbuf) {
  const int64_t gs = K / G;
  for (int64_t g = 0; g < G; ++g) {
    for (int n = 0; n < NT; ++n) {
      const int64_t t = t0 + n;
      const float* s = sp + (t * G + g) * 16;
      const float* o = op + (t * G + g) * 16;
      for (int64_t k = 0; k < gs; k += 2)
        Pair(cp + (t * (K / 2) + (g * gs + k) / 2) * 16)
            .expand(s, o, wbuf + k * NT * 16 + n * 16, wbuf + (k + 1) * NT * 16 + n * 16);
    }
    for (int64_t m0 = 0; m0 < M; m0 += GEMM_MC)
      gemm_rows_dispatch<GEMM_MC, NT>(std::min<int64_t>(GEMM_MC, M - m0), xp + m0 * K + g * gs, K, wbuf, NT * 16,
                                      16, gs, yp + m0 * N + t0 * 16, N, g == 0);
  }
}

template <int NT>
void gemm_tiles_dispatch(int64_t nt, int64_t t0, int64_t M, int64_t K, int64_t G, const float* xp, const uint8_t* cp,
                         const float* sp, const float* op, float* yp, int64_t N, float* wbuf) {
  if (nt == NT) {
    gemm_tiles<NT>(t0, M, K, G, xp, cp, sp, op, yp, N, wbuf);
  } else if constexpr (NT > 1) {
    gemm_tiles_dispatch<NT - 1>(nt, t0, M, K, G, xp, cp, sp, op, yp, N, wbuf);
  }
}


}  // namespace

// out [M, N] = x [M, K] @ w.T (+ bias), w given as 4-bit codes [N/16, K/2, 16], scales and s*z offsets
// [N/16, G, 16] with groups of K/G input columns.
void int4_linear(torch::Tensor x, torch::Tensor codes, torch::Tensor scales, torch::Tensor offsets,
                 c10::optional<torch::Tensor> bias, torch::Tensor out, int64_t small_rows) {
  TORCH_CHECK(x.dtype() == torch::kFloat && scales.dtype() == torch::kFloat && offsets.dtype() == torch::kFloat
              && codes.dtype() == torch::kUInt8 && out.dtype() == torch::kFloat, "int4_linear: fp32 x, uint8 codes");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && codes.is_contiguous() && scales.is_contiguous()
              && offsets.is_contiguous() && out.is_contiguous(), "int4_linear: contiguous tensors");
  const int64_t M = x.size(0), K = x.size(1), T = codes.size(0), G = scales.size(1), N = T * 16;
  TORCH_CHECK(codes.size(1) * 2 == K && codes.size(2) == 16 && K % G == 0 && (K / G) % 2 == 0
              && out.size(0) == M && out.size(1) == N, "int4_linear: shape mismatch");
  TORCH_CHECK(!bias || (bias->dtype() == torch::kFloat && bias->numel() == N), "int4_linear: bias [N] fp32");
  const int64_t gs = K / G;
  const float* xp = x.data_ptr<float>();
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  const float* sp = scales.data_ptr<float>();
  const float* op = offsets.data_ptr<float>();
  const float* bp = bias ? bias->data_ptr<float>() : nullptr;
  float* yp = out.data_ptr<float>();
  if (M > small_rows) {
    const int64_t blocks = (T + GEMM_NT - 1) / GEMM_NT;
    at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> wbuf(gs * GEMM_NT * 16);
      for (int64_t b = begin; b < end; ++b) {
        const int64_t t0 = b * GEMM_NT;
        gemm_tiles_dispatch<GEMM_NT>(std::min<int64_t>(GEMM_NT, T - t0), t0, M, K, G, xp, cp, sp, op, yp, N,
                                     wbuf.data());
      }
    });
    if (bp)
      for (int64_t m = 0; m < M; ++m)
        for (int64_t n = 0; n < N; ++n) yp[m * N + n] += bp[n];
    return;
  }
  std::vector<float> xsum(M * G);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < G; ++g) {
      float s = 0.f;
      for (int64_t k = g * gs; k < (g + 1) * gs; ++k) s += xp[m * K + k];
      xsum[m * G + g] = s;
    }
  at::parallel_for(0, T, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const uint8_t* c = cp + t * (K / 2) * 16;
      const float* b = bp ? bp + t * 16 : nullptr;
      for (int64_t m0 = 0; m0 < M; m0 += ROWS) {
        const int64_t mc = std::min<int64_t>(ROWS, M - m0);
        tile_rows_dispatch<ROWS>(mc, xp + m0 * K, K, c, sp + t * G * 16, op + t * G * 16, xsum.data() + m0 * G,
                                 G, gs, yp + m0 * N + t * 16, N, b);
      }
    }
  });
}


// w.T [K, N] fp32 from the packed form (the weights the codes stand for, transposed), into out: each column pair
// of a tile is two contiguous 16-float rows of w.T, so every write is a full vector.
void int4_expand(torch::Tensor codes, torch::Tensor scales, torch::Tensor offsets, torch::Tensor out) {
  TORCH_CHECK(codes.is_contiguous() && scales.is_contiguous() && offsets.is_contiguous() && out.is_contiguous()
              && out.dtype() == torch::kFloat, "int4_expand: contiguous tensors, fp32 out");
  const int64_t T = codes.size(0), K = codes.size(1) * 2, G = scales.size(1), gs = K / G, N = T * 16;
  TORCH_CHECK(out.size(0) == K && out.size(1) == N, "int4_expand: out must be [K, N]");
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  const float* sp = scales.data_ptr<float>();
  const float* op = offsets.data_ptr<float>();
  float* wp = out.data_ptr<float>();
  at::parallel_for(0, T, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      for (int64_t g = 0; g < G; ++g) {
        const float* s = sp + (t * G + g) * 16;
        const float* o = op + (t * G + g) * 16;
        for (int64_t k = g * gs; k < (g + 1) * gs; k += 2)
          Pair(cp + (t * (K / 2) + k / 2) * 16).expand(s, o, wp + k * N + t * 16, wp + (k + 1) * N + t * 16);
      }
  });
}
"""

_module: ModuleType | None = None
_tried = False


def load() -> ModuleType | None:
    """The compiled kernels (``int4_linear``, ``int4_expand``), or None when they cannot be built here."""
    global _module, _tried
    if not _tried:
        _tried = True
        _module = cpu_kernels.build("llm_lifecycle_int4", CPP_SOURCE, ["int4_linear", "int4_expand"])
    return _module


class Int4Linear:
    """``y = x @ w.T + b`` for a weight held as 4-bit codes (see the module docstring); fp32 in and out."""

    __slots__ = ("codes", "scales", "offsets", "bias", "out_features", "in_features", "kernels", "small_rows")

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor, bias: torch.Tensor | None,
                 kernels: ModuleType, small_rows: int = DEFAULT_SMALL_ROWS) -> None:
        self.codes, self.scales, self.offsets = codes, scales, offsets
        self.bias = None if bias is None else bias.float().contiguous()
        self.out_features = codes.shape[0] * TILE
        self.in_features = codes.shape[1] * 2
        self.small_rows = small_rows
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

    def dense_weight(self) -> torch.Tensor:
        """The fp32 weight [N, K] the codes stand for (a new tensor)."""
        wt = torch.empty(self.in_features, self.out_features, dtype=torch.float32)
        self.kernels.int4_expand(self.codes, self.scales, self.offsets, wt)
        return wt.T.contiguous()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        out = torch.empty(x.shape[0], self.out_features, dtype=torch.float32)
        self.kernels.int4_linear(x, self.codes, self.scales, self.offsets, self.bias, out, self.small_rows)
        return out
