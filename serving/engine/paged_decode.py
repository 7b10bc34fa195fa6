"""Decode attention straight from the paged KV cache: a small C++ kernel, compiled on first use.

The torch path (``attention.paged_attention`` with decode groups) copies every decoding sequence's K/V
blocks into a padded tensor (``index_select``) and then runs SDPA over the copy, so the cache is read,
written and read again. This kernel reads each sequence's K and V once, block by block through its block
table: per (sequence, KV head) it scores the ``group`` query heads against every cached key, takes the
softmax (max-subtracted, a Cephes-style vectorizable ``exp``), and sums the values. fp32 only; contiguous
caches ``[num_blocks, block_size, kv_heads, head_dim]``. Work is split over (sequence, KV head) with
``at::parallel_for``.

It is built with ``torch.utils.cpp_extension.load_inline`` (cached under ``~/.cache/torch_extensions``,
about a minute the first time) when a C++ compiler is present. ``load()`` returns None, and the engine keeps
the torch path, when there is no compiler, the build fails, or ``LLM_LIFECYCLE_PAGED_KERNEL=0`` is set.
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Callable

import torch

log = logging.getLogger(__name__)

ENV_SWITCH = "LLM_LIFECYCLE_PAGED_KERNEL"  # "0" keeps the pure-torch decode attention

CPP_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <cstdint>
#include <vector>

namespace {

// exp(x) for x <= 0 (Cephes expf: range reduction by ln 2, degree-5 polynomial, 2^n by exponent bits).
// Relative error ~1e-7; plain arithmetic so `omp simd` loops vectorize it.
inline float exp_nonpos(float x) {
  x = x < -87.0f ? -87.0f : x;
  float fx = x * 1.44269504088896341f + 0.5f;
  float fl = static_cast<float>(static_cast<int32_t>(fx));
  fl = fl > fx ? fl - 1.0f : fl;  // floor
  float r = x - fl * 0.693359375f + fl * 2.12194440e-4f;
  float y = 1.9875691500e-4f;
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * r * r + r + 1.0f;
  int32_t bits = (static_cast<int32_t>(fl) + 127) << 23;
  return y * __builtin_bit_cast(float, bits);
}

// Pull one block's rows for one KV head toward the cache ahead of use.
inline void prefetch_block(const float* b, int64_t n, int64_t tok_stride, int64_t D) {
  for (int64_t j = 0; j < n; ++j)
    for (int64_t d = 0; d < D; d += 16) __builtin_prefetch(b + j * tok_stride + d);
}

// One (sequence, KV head): q [G, D] -> out [G, D]; s is scratch for G * len scores. GC/DC > 0 fix G/D at
// compile time (the common shapes), 0 reads them from g_rt/d_rt.
template <int64_t GC, int64_t DC>
void attend(const float* q, const float* kc, const float* vc, const int64_t* table, int64_t len,
            int64_t bs, int64_t tok_stride, int64_t blk_stride, int64_t g_rt, int64_t d_rt, float scale,
            float* out, float* s) {
  const int64_t G = GC > 0 ? GC : g_rt;
  const int64_t D = DC > 0 ? DC : d_rt;
  const int64_t nblk = (len + bs - 1) / bs;
  for (int64_t bi = 0; bi < nblk; ++bi) {
    const float* kb = kc + table[bi] * blk_stride;
    const int64_t n = std::min(bs, len - bi * bs);
    if (bi + 1 < nblk) prefetch_block(kc + table[bi + 1] * blk_stride, bs, tok_stride, D);
    for (int64_t j = 0; j < n; ++j) {
      const float* k = kb + j * tok_stride;
      float* st = s + bi * bs + j;
      for (int64_t g = 0; g < G; ++g) {
        const float* qg = q + g * D;
        float acc = 0.f;
#pragma omp simd reduction(+ : acc)
        for (int64_t d = 0; d < D; ++d) acc += qg[d] * k[d];
        st[g * len] = acc * scale;
      }
    }
  }
  for (int64_t g = 0; g < G; ++g) {
    float* sg = s + g * len;
    float m = sg[0];
#pragma omp simd reduction(max : m)
    for (int64_t t = 0; t < len; ++t) m = std::max(m, sg[t]);
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t t = 0; t < len; ++t) {
      float e = exp_nonpos(sg[t] - m);
      sg[t] = e;
      sum += e;
    }
    const float inv = 1.f / sum;
#pragma omp simd
    for (int64_t t = 0; t < len; ++t) sg[t] *= inv;
  }
  float acc[GC > 0 && DC > 0 ? GC * DC : 1];
  float* o = GC > 0 && DC > 0 ? acc : out;
  std::fill(o, o + G * D, 0.f);
  for (int64_t bi = 0; bi < nblk; ++bi) {
    const float* vb = vc + table[bi] * blk_stride;
    const int64_t n = std::min(bs, len - bi * bs);
    if (bi + 1 < nblk) prefetch_block(vc + table[bi + 1] * blk_stride, bs, tok_stride, D);
    for (int64_t j = 0; j < n; ++j) {
      const float* v = vb + j * tok_stride;
      const float* pt = s + bi * bs + j;
      for (int64_t g = 0; g < G; ++g) {
        const float p = pt[g * len];
        float* og = o + g * D;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) og[d] += p * v[d];
      }
    }
  }
  if (o != out) std::copy(o, o + G * D, out);
}

// Vectorized (GCC vector extensions, 16 floats) path for G % 4 == 0 and D % 16 == 0: the common shapes.
typedef float v16 __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));

inline v16 load16(const float* p) { v16 v; std::memcpy(&v, p, sizeof v); return v; }
inline void store16(float* p, v16 v) { std::memcpy(p, &v, sizeof v); }

inline v16 exp16(v16 x) {  // exp_nonpos on 16 lanes; lanes below -87 (incl. -inf padding) give 0
  const v16 lo = x < -87.0f ? (v16){} + 1.0f : (v16){};
  x = x < -87.0f ? (v16){} - 87.0f : x;
  v16 fx = x * 1.44269504088896341f + 0.5f;
  v16i fi = __builtin_convertvector(fx, v16i);
  v16 fl = __builtin_convertvector(fi, v16);
  fl = fl > fx ? fl - 1.0f : fl;
  v16 r = x - fl * 0.693359375f + fl * 2.12194440e-4f;
  v16 y = r * 1.9875691500e-4f + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * r * r + r + 1.0f;
  v16i bits = (__builtin_convertvector(fl, v16i) + 127) << 23;
  y = y * (v16)bits;
  return lo > 0.5f ? (v16){} : y;
}

// [sum(a), sum(b), sum(c), sum(d)] in lanes 0, 4, 8, 12.
inline v16 hsum4(v16 a, v16 b, v16 c, v16 d) {
  v16 ab = __builtin_shufflevector(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23)
         + __builtin_shufflevector(a, b, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  v16 cd = __builtin_shufflevector(c, d, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23)
         + __builtin_shufflevector(c, d, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  v16 e = __builtin_shufflevector(ab, cd, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27)
        + __builtin_shufflevector(ab, cd, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  e = e + __builtin_shufflevector(e, e, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
  return e + __builtin_shufflevector(e, e, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
}

// As attend<>, for G % 4 == 0, D % 16 == 0; s holds G rows of lp = len rounded up to 16 scores.
template <int64_t G, int64_t D>
void attend16(const float* q, const float* kc, const float* vc, const int64_t* table, int64_t len,
              int64_t bs, int64_t tok_stride, int64_t blk_stride, float scale, float* out, float* s) {
  constexpr int64_t NC = D / 16;
  const int64_t lp = (len + 15) / 16 * 16;
  const int64_t nblk = (len + bs - 1) / bs;
  v16 qv[G][NC];
  for (int64_t g = 0; g < G; ++g)
    for (int64_t c = 0; c < NC; ++c) qv[g][c] = load16(q + g * D + c * 16) * scale;
  for (int64_t bi = 0; bi < nblk; ++bi) {
    const float* kb = kc + table[bi] * blk_stride;
    const int64_t n = std::min(bs, len - bi * bs);
    if (bi + 1 < nblk) prefetch_block(kc + table[bi + 1] * blk_stride, bs, tok_stride, D);
    for (int64_t j = 0; j < n; ++j) {
      const float* k = kb + j * tok_stride;
      v16 kv[NC];
      for (int64_t c = 0; c < NC; ++c) kv[c] = load16(k + c * 16);
      float* st = s + bi * bs + j;
      for (int64_t g0 = 0; g0 < G; g0 += 4) {
        v16 a[4];
        for (int64_t u = 0; u < 4; ++u) {
          a[u] = qv[g0 + u][0] * kv[0];
          for (int64_t c = 1; c < NC; ++c) a[u] += qv[g0 + u][c] * kv[c];
        }
        v16 r = hsum4(a[0], a[1], a[2], a[3]);
        st[(g0 + 0) * lp] = r[0];
        st[(g0 + 1) * lp] = r[4];
        st[(g0 + 2) * lp] = r[8];
        st[(g0 + 3) * lp] = r[12];
      }
    }
  }
  for (int64_t g = 0; g < G; ++g) {
    float* sg = s + g * lp;
    for (int64_t t = len; t < lp; ++t) sg[t] = -INFINITY;
    v16 mv = load16(sg);
    for (int64_t t = 16; t < lp; t += 16) { v16 x = load16(sg + t); mv = x > mv ? x : mv; }
    float m = mv[0];
    for (int i = 1; i < 16; ++i) m = std::max(m, mv[i]);
    v16 sv = {};
    for (int64_t t = 0; t < lp; t += 16) { v16 e = exp16(load16(sg + t) - m); store16(sg + t, e); sv += e; }
    float sum = 0.f;
    for (int i = 0; i < 16; ++i) sum += sv[i];
    const float inv = 1.f / sum;
    for (int64_t t = 0; t < lp; t += 16) store16(sg + t, load16(sg + t) * inv);
  }
  v16 acc[G][NC] = {};
  for (int64_t bi = 0; bi < nblk; ++bi) {
    const float* vb = vc + table[bi] * blk_stride;
    const int64_t n = std::min(bs, len - bi * bs);
    if (bi + 1 < nblk) prefetch_block(vc + table[bi + 1] * blk_stride, bs, tok_stride, D);
    for (int64_t j = 0; j < n; ++j) {
      const float* v = vb + j * tok_stride;
      v16 vv[NC];
      for (int64_t c = 0; c < NC; ++c) vv[c] = load16(v + c * 16);
      const float* pt = s + bi * bs + j;
      for (int64_t g = 0; g < G; ++g) {
        const float p = pt[g * lp];
        for (int64_t c = 0; c < NC; ++c) acc[g][c] += p * vv[c];
      }
    }
  }
  for (int64_t g = 0; g < G; ++g)
    for (int64_t c = 0; c < NC; ++c) store16(out + g * D + c * 16, acc[g][c]);
}

}  // namespace

// q [B, H, D]; caches [NB, bs, KVH, D]; block_tables [B, max_blocks] int64; context_lens [B] int64;
// out [B, H, D] (written).
void paged_decode(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor block_tables,
                  torch::Tensor context_lens, double scale, torch::Tensor out) {
  TORCH_CHECK(q.dtype() == torch::kFloat && k_cache.dtype() == torch::kFloat && v_cache.dtype() == torch::kFloat
              && out.dtype() == torch::kFloat, "paged_decode: fp32 only");
  TORCH_CHECK(q.is_contiguous() && out.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous()
              && block_tables.is_contiguous() && context_lens.is_contiguous(), "paged_decode: contiguous inputs");
  TORCH_CHECK(block_tables.dtype() == torch::kLong && context_lens.dtype() == torch::kLong,
              "paged_decode: int64 block tables and lengths");
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t bs = k_cache.size(1), KVH = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == D && H % KVH == 0, "paged_decode: shape mismatch");
  const int64_t G = H / KVH, max_blocks = block_tables.size(1);
  const int64_t tok_stride = KVH * D, blk_stride = bs * KVH * D;
  const float* qp = q.data_ptr<float>();
  const float* kp = k_cache.data_ptr<float>();
  const float* vp = v_cache.data_ptr<float>();
  const int64_t* tp = block_tables.data_ptr<int64_t>();
  const int64_t* lp = context_lens.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  const float sc = static_cast<float>(scale);
  int64_t max_len = 1;
  for (int64_t b = 0; b < B; ++b) max_len = std::max(max_len, lp[b]);
  at::parallel_for(0, B * KVH, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch(G * ((max_len + 15) / 16 * 16));
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = i / KVH, h = i % KVH, len = lp[b];
      const float* qi = qp + (b * H + h * G) * D;
      float* oi = op + (b * H + h * G) * D;
      const float* ki = kp + h * D;
      const float* vi = vp + h * D;
      const int64_t* tab = tp + b * max_blocks;
      float* sp = scratch.data();
      if (G == 4 && D == 64) attend16<4, 64>(qi, ki, vi, tab, len, bs, tok_stride, blk_stride, sc, oi, sp);
      else if (G == 8 && D == 64) attend16<8, 64>(qi, ki, vi, tab, len, bs, tok_stride, blk_stride, sc, oi, sp);
      else if (G == 4 && D == 128) attend16<4, 128>(qi, ki, vi, tab, len, bs, tok_stride, blk_stride, sc, oi, sp);
      else if (G == 4 && D == 16) attend16<4, 16>(qi, ki, vi, tab, len, bs, tok_stride, blk_stride, sc, oi, sp);
      else attend<0, 0>(qi, ki, vi, tab, len, bs, tok_stride, blk_stride, G, D, sc, oi, sp);
    }
  });
}
"""

_kernel: Callable[..., None] | None = None
_tried = False


def load() -> Callable[..., None] | None:
    """The compiled ``paged_decode(q, k_cache, v_cache, block_tables, context_lens, scale, out)``, or None."""
    global _kernel, _tried
    if _tried:
        return _kernel
    _tried = True
    if os.environ.get(ENV_SWITCH, "1") == "0":
        log.info("paged decode kernel disabled by %s=0", ENV_SWITCH)
        return None
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        log.info("no C++ compiler: decode attention uses the torch path")
        return None
    try:
        from torch.utils.cpp_extension import load_inline

        mod = load_inline("llm_lifecycle_paged_decode", CPP_SOURCE, functions=["paged_decode"],
                          extra_cflags=["-O3", "-march=native", "-fopenmp-simd"])
        _kernel = mod.paged_decode
    except Exception as e:  # any build or load failure means: use the torch path
        log.warning("paged decode kernel unavailable (%s: %s); decode attention uses the torch path",
                    type(e).__name__, e)
    return _kernel


def supported(k_cache: torch.Tensor) -> bool:
    """Whether the kernel handles a KV cache like this one (contiguous fp32 on CPU)."""
    return k_cache.device.type == "cpu" and k_cache.dtype == torch.float32 and k_cache.is_contiguous()
