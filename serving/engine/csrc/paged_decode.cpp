// Decode attention straight from the paged KV cache: paged_decode (serving/engine/cpu_kernels.py describes it).
#include "cpu_kernels.h"
#include "vec16.h"
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

// Generic shapes, one (sequence, KV head): q [G, D] -> out [G, D]; s is scratch for G * len scores.
void attend(const float* q, const float* kc, const float* vc, const int64_t* table, int64_t len, int64_t bs,
            int64_t tok_stride, int64_t blk_stride, int64_t G, int64_t D, float scale, float* out, float* s) {
  for (int64_t t = 0; t < len; ++t) {
    const float* k = kc + table[t / bs] * blk_stride + (t % bs) * tok_stride;
    for (int64_t g = 0; g < G; ++g) {
      const float* qg = q + g * D;
      float acc = 0.f;
#pragma omp simd reduction(+ : acc)
      for (int64_t d = 0; d < D; ++d) acc += qg[d] * k[d];
      s[g * len + t] = acc * scale;
    }
  }
  for (int64_t g = 0; g < G; ++g) {
    float* sg = s + g * len;
    float m = sg[0];
    for (int64_t t = 1; t < len; ++t) m = std::max(m, sg[t]);
    float sum = 0.f;
    for (int64_t t = 0; t < len; ++t) {
      sg[t] = exp_nonpos(sg[t] - m);
      sum += sg[t];
    }
    for (int64_t t = 0; t < len; ++t) sg[t] /= sum;
  }
  std::fill(out, out + G * D, 0.f);
  for (int64_t t = 0; t < len; ++t) {
    const float* v = vc + table[t / bs] * blk_stride + (t % bs) * tok_stride;
    for (int64_t g = 0; g < G; ++g) {
      const float p = s[g * len + t];
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) out[g * D + d] += p * v[d];
    }
  }
}

// Vectorized (GCC vector extensions, 16 floats) path for G % 4 == 0 and D % 16 == 0: the common shapes.

// Softmax in place over each of `rows` rows of lp (a multiple of 16) scores, of which the first len count. On the
// native vector width: 16 lanes on AVX-512, else 8 (GCC's 16-lane code on AVX2 was several times slower).
inline void softmax_rows(float* s, int64_t rows, int64_t len, int64_t lp) {
  constexpr int64_t L = NAT_LANES;
  for (int64_t g = 0; g < rows; ++g) {
    float* sg = s + g * lp;
    for (int64_t t = len; t < lp; ++t) sg[t] = -INFINITY;
    vnat mv = load_nat(sg);
    for (int64_t t = L; t < lp; t += L) { vnat x = load_nat(sg + t); mv = x > mv ? x : mv; }
    float m = mv[0];
    for (int i = 1; i < L; ++i) m = std::max(m, mv[i]);
    vnat sv = {};
    for (int64_t t = 0; t < lp; t += L) {
      const vnat e = exp_lanes<vnat, vnati>(load_nat(sg + t) - m);
      store_nat(sg + t, e);
      sv += e;
    }
    float sum = 0.f;
    for (int i = 0; i < L; ++i) sum += sv[i];
    const float inv = 1.f / sum;
    for (int64_t t = 0; t < lp; t += L) store_nat(sg + t, load_nat(sg + t) * inv);
  }
}

// One sequence, all KV heads: q [KVH * G, D] -> out [KVH * G, D], for G % 4 == 0 and D % 16 == 0. Each
// block (block_size rows of KVH * D floats, contiguous) is read once per pass while it sits in L1, and the
// next block's K (and this block's V, toward L2 for the second pass) is prefetched a row per row used
// (each step of that layout measured faster than the one before; decode attention of 8 layers, 64 sequences,
// contexts 32-512, K/V from DRAM: one KV head at a time 9.4 ms, all KV heads per block with the row-spread
// prefetch 8.8 ms, with this block's V pulled toward L2 7.7-8.3 ms; with no software prefetch 15 ms).
// s holds KVH * G rows of lp = len rounded up to 16 scores.
template <int64_t G, int64_t D>
void attend16(const float* q, const float* kc, const float* vc, const int64_t* table, int64_t len,
              int64_t bs, int64_t kvh, float scale, float* out, float* s) {
  constexpr int64_t NC = D / 16;
  const int64_t tok_stride = kvh * D, blk_stride = bs * kvh * D;
  const int64_t lp = (len + 15) / 16 * 16;
  const int64_t nblk = (len + bs - 1) / bs;
  for (int64_t bi = 0; bi < nblk; ++bi) {
    const float* kb = kc + table[bi] * blk_stride;
    const int64_t n = std::min(bs, len - bi * bs);
    const float* kpf = bi + 1 < nblk ? kc + table[bi + 1] * blk_stride : nullptr;
    const float* vpf1 = vc + table[bi] * blk_stride;  // V of this block, toward L2 for the second pass
    for (int64_t h = 0; h < kvh; ++h) {
      v16 qv[G][NC];
      for (int64_t g = 0; g < G; ++g)
        for (int64_t c = 0; c < NC; ++c) qv[g][c] = load16(q + (h * G + g) * D + c * 16) * scale;
      for (int64_t j = 0; j < n; ++j) {
        if (h == 0) {
          if (kpf) prefetch(kpf + j * tok_stride, tok_stride);
          for (int64_t d = 0; d < tok_stride; d += 16) __builtin_prefetch(vpf1 + j * tok_stride + d, 0, 2);  // L2
        }
        const float* k = kb + j * tok_stride + h * D;
        v16 kv[NC];
        for (int64_t c = 0; c < NC; ++c) kv[c] = load16(k + c * 16);
        float* st = s + h * G * lp + bi * bs + j;
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
  }
  softmax_rows(s, kvh * G, len, lp);
  std::fill(out, out + kvh * G * D, 0.f);
  for (int64_t bi = 0; bi < nblk; ++bi) {
    const float* vb = vc + table[bi] * blk_stride;
    const int64_t n = std::min(bs, len - bi * bs);
    const float* vpf = bi + 1 < nblk ? vc + table[bi + 1] * blk_stride : nullptr;
    for (int64_t h = 0; h < kvh; ++h) {
      v16 acc[G][NC];
      for (int64_t g = 0; g < G; ++g)
        for (int64_t c = 0; c < NC; ++c) acc[g][c] = load16(out + (h * G + g) * D + c * 16);
      for (int64_t j = 0; j < n; ++j) {
        if (h == 0 && vpf) prefetch(vpf + j * tok_stride, tok_stride);
        const float* v = vb + j * tok_stride + h * D;
        v16 vv[NC];
        for (int64_t c = 0; c < NC; ++c) vv[c] = load16(v + c * 16);
        const float* pt = s + h * G * lp + bi * bs + j;
        for (int64_t g = 0; g < G; ++g) {
          const float p = pt[g * lp];
          for (int64_t c = 0; c < NC; ++c) acc[g][c] += p * vv[c];
        }
      }
      for (int64_t g = 0; g < G; ++g)
        for (int64_t c = 0; c < NC; ++c) store16(out + (h * G + g) * D + c * 16, acc[g][c]);
    }
  }
}

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
// AVX2 + FMA path, for x86 hosts without AVX-512 (where the 16-lane path above runs natively and stays). On
// AVX2 the 16-lane path keeps G * D / 16 query vectors live, twice the 16 ymm registers there are once each
// v16 splits in two, and spills on every key row; this one keeps at most 11 registers live in the score
// pass and 10 in the value pass, and reduces eight dot products with one transpose (hsum8x8) instead of a
// shuffle tree per four.
// Rows are found through the block table by shift and mask (block sizes are powers of two). Each row used
// prefetches the same row of the sequence's next block (blocks are scattered, so the hardware prefetcher cannot
// follow): 64 sequences of 64-256 tokens, 2.1-2.6 ms a layer without it, 0.53-0.75 ms with it (AMD EPYC, AVX2).

// [sum(a[0]), ..., sum(a[7])]
inline __m256 hsum8x8(const __m256* a) {
  const __m256 h01 = _mm256_hadd_ps(a[0], a[1]), h23 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 h45 = _mm256_hadd_ps(a[4], a[5]), h67 = _mm256_hadd_ps(a[6], a[7]);
  const __m256 h0123 = _mm256_hadd_ps(h01, h23), h4567 = _mm256_hadd_ps(h45, h67);
  return _mm256_add_ps(_mm256_permute2f128_ps(h0123, h4567, 0x20), _mm256_permute2f128_ps(h0123, h4567, 0x31));
}

// One sequence, all KV heads, G in {4, 8}, D % 16 == 0: q [KVH * G, D] -> out [KVH * G, D]; s holds
// KVH * G rows of lp = len rounded up to 16 scores.
template <int64_t G, int64_t D>
void attend_avx2(const float* q, const float* kc, const float* vc, const int64_t* table, int64_t len,
                 int64_t bs, int64_t kvh, float scale, float* out, float* s) {
  static_assert((G == 4 || G == 8) && D % 16 == 0, "attend_avx2: G in {4, 8}, D % 16 == 0");
  constexpr int64_t NC = D / 8;
  const int64_t tok_stride = kvh * D, blk_stride = bs * kvh * D;
  const int64_t lp = (len + 15) / 16 * 16;
  const int shift = __builtin_ctzll(static_cast<unsigned long long>(bs));
  const int64_t mask = bs - 1;
  auto row = [&](const float* cache, int64_t t, int64_t h) {
    return cache + table[t >> shift] * blk_stride + (t & mask) * tok_stride + h * D;
  };
  alignas(32) float qs[G * D];
  alignas(32) float r8[8];
  for (int64_t h = 0; h < kvh; ++h) {
    for (int64_t i = 0; i < G * D; ++i) qs[i] = q[h * G * D + i] * scale;
    float* sh = s + h * G * lp;
    if constexpr (G == 8) {
      for (int64_t t = 0; t < len; ++t) {
        if (t + bs < len) prefetch(row(kc, t + bs, h), D);  // the same row of the next block: blocks are scattered
        const float* k = row(kc, t, h);
        __m256 a[8];
        for (int g = 0; g < 8; ++g) a[g] = _mm256_setzero_ps();
        for (int64_t c = 0; c < NC; ++c) {
          const __m256 kv = _mm256_loadu_ps(k + c * 8);
          for (int g = 0; g < 8; ++g) a[g] = _mm256_fmadd_ps(_mm256_load_ps(qs + g * D + c * 8), kv, a[g]);
        }
        _mm256_store_ps(r8, hsum8x8(a));
        for (int g = 0; g < 8; ++g) sh[g * lp + t] = r8[g];
      }
    } else {  // G == 4: two key rows at a time fill the eight accumulators
      for (int64_t t = 0; t < len; t += 2) {
        if (t + bs < len) prefetch(row(kc, t + bs, h), D);
        if (t + 1 + bs < len) prefetch(row(kc, t + 1 + bs, h), D);
        const float* k0 = row(kc, t, h);
        const float* k1 = t + 1 < len ? row(kc, t + 1, h) : k0;
        __m256 a[8];
        for (int g = 0; g < 8; ++g) a[g] = _mm256_setzero_ps();
        for (int64_t c = 0; c < NC; ++c) {
          const __m256 kv0 = _mm256_loadu_ps(k0 + c * 8), kv1 = _mm256_loadu_ps(k1 + c * 8);
          for (int g = 0; g < 4; ++g) {
            const __m256 qv = _mm256_load_ps(qs + g * D + c * 8);
            a[g] = _mm256_fmadd_ps(qv, kv0, a[g]);
            a[4 + g] = _mm256_fmadd_ps(qv, kv1, a[4 + g]);
          }
        }
        _mm256_store_ps(r8, hsum8x8(a));
        for (int g = 0; g < 4; ++g) sh[g * lp + t] = r8[g];
        if (t + 1 < len)
          for (int g = 0; g < 4; ++g) sh[g * lp + t + 1] = r8[4 + g];
      }
    }
  }
  softmax_rows(s, kvh * G, len, lp);
  // values: CW chunks of 8 output floats per pass over the rows, G * CW accumulators live
  constexpr int64_t CW = G == 4 ? 2 : 1;
  for (int64_t h = 0; h < kvh; ++h) {
    const float* sh = s + h * G * lp;
    for (int64_t c = 0; c < NC; c += CW) {
      __m256 acc[G][CW];
      for (int g = 0; g < G; ++g)
        for (int w = 0; w < CW; ++w) acc[g][w] = _mm256_setzero_ps();
      for (int64_t t = 0; t < len; ++t) {
        if (c == 0 && t + bs < len) prefetch(row(vc, t + bs, h), D);  // the first pass brings whole rows in
        const float* v = row(vc, t, h) + c * 8;
        __m256 vv[CW];
        for (int w = 0; w < CW; ++w) vv[w] = _mm256_loadu_ps(v + w * 8);
        for (int g = 0; g < G; ++g) {
          const __m256 p = _mm256_broadcast_ss(sh + g * lp + t);
          for (int w = 0; w < CW; ++w) acc[g][w] = _mm256_fmadd_ps(p, vv[w], acc[g][w]);
        }
      }
      for (int g = 0; g < G; ++g)
        for (int w = 0; w < CW; ++w) _mm256_storeu_ps(out + (h * G + g) * D + (c + w) * 8, acc[g][w]);
    }
  }
}
#define LLM_LIFECYCLE_HAVE_AVX2 1
#endif

}  // namespace

// The vectorized kernels are templates over (G, D); `vec` has checked G in {4, 8} and D in {16, 64, 128}.
#define ATTEND_VECTORIZED(KERNEL)                                                         \
  do {                                                                                    \
    if (G == 4 && D == 64) KERNEL<4, 64>(qb, kp, vp, tab, len, bs, KVH, sc, ob, sp);      \
    else if (G == 8 && D == 64) KERNEL<8, 64>(qb, kp, vp, tab, len, bs, KVH, sc, ob, sp); \
    else if (G == 4 && D == 128) KERNEL<4, 128>(qb, kp, vp, tab, len, bs, KVH, sc, ob, sp); \
    else if (G == 8 && D == 128) KERNEL<8, 128>(qb, kp, vp, tab, len, bs, KVH, sc, ob, sp); \
    else if (G == 4 && D == 16) KERNEL<4, 16>(qb, kp, vp, tab, len, bs, KVH, sc, ob, sp); \
    else KERNEL<8, 16>(qb, kp, vp, tab, len, bs, KVH, sc, ob, sp);                        \
  } while (0)

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
  const bool vec = G % 4 == 0 && (D == 16 || D == 64 || D == 128) && G <= 8;
  const int64_t lp_max = (max_len + 15) / 16 * 16;
  at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch(H * lp_max);
    float* sp = scratch.data();
    for (int64_t b = begin; b < end; ++b) {
      const int64_t len = lp[b];
      const float* qb = qp + b * H * D;
      float* ob = op + b * H * D;
      const int64_t* tab = tp + b * max_blocks;
#ifdef LLM_LIFECYCLE_HAVE_AVX2
      if (vec && (bs & (bs - 1)) == 0) {
        ATTEND_VECTORIZED(attend_avx2);
        continue;
      }
#endif
      if (vec) {
        ATTEND_VECTORIZED(attend16);
        continue;
      }
      for (int64_t h = 0; h < KVH; ++h)
        attend(qb + h * G * D, kp + h * D, vp + h * D, tab, len, bs, tok_stride, blk_stride, G, D, sc,
                     ob + h * G * D, sp);
    }
  });
}
