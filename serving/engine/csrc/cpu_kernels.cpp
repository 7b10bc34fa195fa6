// CPU kernels of the engine's fp32 path (built by serving/engine/cpu_kernels.py, whose docstring describes
// them): paged_decode, paged_prefill, add_rms_norm, silu_mul and rope.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <cstdint>
#include <vector>
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

// exp(x) for x <= 0 (Cephes expf: range reduction by ln 2, degree-5 polynomial, 2^n by exponent bits).
// Relative error ~1e-7; exp16 below is the same on 16 lanes.
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

// Prefetch n floats from p (one cache line per 16).
inline void prefetch(const float* p, int64_t n) {
  for (int64_t d = 0; d < n; d += 16) __builtin_prefetch(p + d);
}

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

// Softmax in place over each of `rows` rows of lp (a multiple of 16) scores, of which the first len count.
inline void softmax_rows(float* s, int64_t rows, int64_t len, int64_t lp) {
  for (int64_t g = 0; g < rows; ++g) {
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
// Rows are found through the block table by shift and mask (block sizes are powers of two).

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

// h [T, N] += delta [T, N] (when given, in place); out [T, N] = h * rsqrt(mean(h^2) + eps) * weight [N].
void add_rms_norm(torch::Tensor h, c10::optional<torch::Tensor> delta, torch::Tensor weight, double eps,
                  torch::Tensor out) {
  TORCH_CHECK(h.dtype() == torch::kFloat && weight.dtype() == torch::kFloat && out.dtype() == torch::kFloat
              && (!delta || delta->dtype() == torch::kFloat), "add_rms_norm: fp32 only");
  TORCH_CHECK(h.dim() == 2 && h.is_contiguous() && out.is_contiguous() && weight.is_contiguous()
              && (!delta || (delta->is_contiguous() && delta->sizes() == h.sizes())),
              "add_rms_norm: contiguous [T, N]");
  const int64_t T = h.size(0), N = h.size(1), NV = N / 16 * 16;
  float* hp = h.data_ptr<float>();
  const float* dp = delta ? delta->data_ptr<float>() : nullptr;
  const float* wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float e = static_cast<float>(eps);
  at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      float* hr = hp + t * N;
      float* orow = op + t * N;
      v16 acc = {};
      float tail = 0.f;
      for (int64_t i = 0; i < NV; i += 16) {
        v16 a = load16(hr + i);
        if (dp) { a += load16(dp + t * N + i); store16(hr + i, a); }
        acc += a * a;
      }
      for (int64_t i = NV; i < N; ++i) {
        if (dp) hr[i] += dp[t * N + i];
        tail += hr[i] * hr[i];
      }
      float ss = tail;
      for (int k = 0; k < 16; ++k) ss += acc[k];
      const float r = 1.f / std::sqrt(ss / static_cast<float>(N) + e);
      for (int64_t i = 0; i < NV; i += 16) store16(orow + i, load16(hr + i) * r * load16(wp + i));
      for (int64_t i = NV; i < N; ++i) orow[i] = hr[i] * r * wp[i];
    }
  });
}

// The SiLU-gated MLP's middle: out [T, I] = silu(gu[:, :I]) * gu[:, I:] for a fused gate/up projection gu [T, 2I]
// (one pass instead of chunk, silu and mul as three ops with two temporaries). silu(x) = x * sigmoid(x), the
// sigmoid from e = exp(-|x|) so the exponential never overflows: 1 / (1 + e) for x >= 0, e / (1 + e) below.
void silu_mul(torch::Tensor gu, torch::Tensor out) {
  TORCH_CHECK(gu.dtype() == torch::kFloat && out.dtype() == torch::kFloat && gu.is_contiguous()
              && out.is_contiguous() && gu.dim() == 2 && out.dim() == 2 && gu.size(0) == out.size(0)
              && gu.size(1) == 2 * out.size(1), "silu_mul: contiguous fp32 gu [T, 2I], out [T, I]");
  const int64_t T = out.size(0), I = out.size(1), IV = I / 16 * 16;
  const float* gp = gu.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, T, 4, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* g = gp + t * 2 * I;
      const float* u = g + I;
      float* o = op + t * I;
      for (int64_t i = 0; i < IV; i += 16) {
        const v16 x = load16(g + i);
        const v16 ax = x < 0.f ? -x : x;
        const v16 e = exp16(-ax);
        const v16 sig = (x >= 0.f ? (v16){} + 1.f : e) / (1.f + e);
        store16(o + i, x * sig * load16(u + i));
      }
      for (int64_t i = IV; i < I; ++i) {
        const float x = g[i], e = exp_nonpos(-std::fabs(x));
        o[i] = x * ((x >= 0.f ? 1.f : e) / (1.f + e)) * u[i];
      }
    }
  });
}

namespace {

inline float hmax16(v16 x) {  // max over the 16 lanes, by halving
  v16 y = __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
  x = x > y ? x : y;
  y = __builtin_shufflevector(x, x, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
  x = x > y ? x : y;
  y = __builtin_shufflevector(x, x, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
  x = x > y ? x : y;
  y = __builtin_shufflevector(x, x, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
  return std::max(x[0], y[0]);
}

inline float hsum16(v16 x) {  // sum over the 16 lanes, by halving
  x += __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
  x += __builtin_shufflevector(x, x, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
  x += __builtin_shufflevector(x, x, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
  return x[0] + x[1];
}

// One work item of paged_prefill: KV head h of one chunk, rows [r0, r0 + nr) of it (positions first_pos, ...),
// all G query heads of h. Flash-style, a group of QG query vectors at a time with its accumulators, running
// max and running sum in registers across every key block it sees: the group's 16 scores per block are D
// multiply-adds each against the block's K transposed to [D][16] (transposed once per item into kt, so no
// horizontal sums), masked past each row's own position, then an online softmax (the accumulators rescaled
// only when the running max grows) and the block's V rows summed in straight from the cache.
template <int64_t D>
void prefill_tile(const float* q, int64_t q_row_stride, const float* kc, const float* vc, const int64_t* table,
                  int64_t first_pos, int64_t nr, int64_t G, int64_t h, int64_t tok_stride, int64_t blk_stride,
                  float scale, float* out, float* kt) {
  constexpr int64_t NC = D / 16;
  constexpr int64_t QG = D <= 64 ? 4 : 2;  // query vectors per group: QG * NC accumulators stay in registers
  const int64_t nq = nr * G;  // query vector i: row i / G, head h * G + i % G
  const int64_t last_pos = first_pos + nr - 1;
  const int64_t nblk = last_pos / 16 + 1;
  for (int64_t b = 0; b < nblk; ++b) {
    const float* kb = kc + table[b] * blk_stride + h * D;
    float* kd = kt + b * D * 16;
    for (int64_t j = 0; j < 16; ++j)
      for (int64_t d = 0; d < D; ++d) kd[d * 16 + j] = kb[j * tok_stride + d];
  }
  const v16 lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  alignas(64) float qs[QG][D];
  alignas(64) float p[QG][16];
  for (int64_t i0 = 0; i0 < nq; i0 += QG) {
    const int64_t n = std::min<int64_t>(QG, nq - i0);
    int64_t pos[QG];
    for (int64_t u = 0; u < QG; ++u) {
      const int64_t i = i0 + std::min(u, n - 1);  // a short last group repeats its last vector (not written)
      pos[u] = first_pos + i / G;
      const float* src = q + (i / G) * q_row_stride + (h * G + i % G) * D;
      for (int64_t d = 0; d < D; ++d) qs[u][d] = src[d] * scale;
    }
    v16 o[QG][NC] = {};
    float m[QG], l[QG];
    for (int64_t u = 0; u < QG; ++u) { m[u] = -INFINITY; l[u] = 0.f; }
    const int64_t blocks = pos[QG - 1] / 16 + 1;  // positions ascend within the group
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t t0 = b * 16;
      const float* kd = kt + b * D * 16;
      // PS partial sums per vector: 8 independent multiply-add chains hide the FMA latency
      constexpr int64_t PS = 8 / QG;
      v16 part[QG][PS] = {};
      for (int64_t d = 0; d < D; d += PS)
        for (int64_t w = 0; w < PS; ++w) {
          const v16 k = load16(kd + (d + w) * 16);
          for (int64_t u = 0; u < QG; ++u) part[u][w] += qs[u][d + w] * k;
        }
      v16 sc[QG];
      for (int64_t u = 0; u < QG; ++u) {
        sc[u] = part[u][0];
        for (int64_t w = 1; w < PS; ++w) sc[u] += part[u][w];
      }
      float corr[QG];
      for (int64_t u = 0; u < QG; ++u) {
        if (pos[u] < t0) {  // this vector's row sees none of the block
          corr[u] = 1.f;
          store16(p[u], (v16){});
          continue;
        }
        if (pos[u] < t0 + 15)  // the diagonal block: keys past the row's own position get no weight
          sc[u] = lane + static_cast<float>(t0) > static_cast<float>(pos[u]) ? (v16){} - INFINITY : sc[u];
        const float m_new = std::max(m[u], hmax16(sc[u]));
        // the running max grew: rescale what was summed under the old one (0 for the first block: -inf - x)
        corr[u] = m_new == m[u] ? 1.f : exp_nonpos(m[u] - m_new);
        const v16 e = exp16(sc[u] - m_new);
        store16(p[u], e);
        l[u] = l[u] * corr[u] + hsum16(e);
        m[u] = m_new;
      }
      for (int64_t u = 0; u < QG; ++u)
        if (corr[u] != 1.f)
          for (int64_t c = 0; c < NC; ++c) o[u][c] *= corr[u];
      const float* vb = vc + table[b] * blk_stride + h * D;
      for (int64_t j = 0; j < 16; ++j) {
        v16 v[NC];
        for (int64_t c = 0; c < NC; ++c) v[c] = load16(vb + j * tok_stride + c * 16);
        for (int64_t u = 0; u < QG; ++u)
          for (int64_t c = 0; c < NC; ++c) o[u][c] += p[u][j] * v[c];
      }
    }
    for (int64_t u = 0; u < n; ++u) {
      const int64_t i = i0 + u;
      float* dst = out + (i / G) * q_row_stride + (h * G + i % G) * D;
      const float inv = 1.f / l[u];
      for (int64_t c = 0; c < NC; ++c) store16(dst + c * 16, o[u][c] * inv);
    }
  }
}

}  // namespace

// Causal attention of prefill (and speculative verify) chunks, straight from the paged cache, their own K/V
// already written there. q/out [R, H, D]: the chunks' rows back to back; chunk p's rows are
// [row_starts[p], row_starts[p + 1]) at positions first_pos[p], first_pos[p] + 1, ...; each row attends to
// the keys at positions 0..its own through block_tables [P, max_blocks] (int64). Block size 16, D in
// {16, 32, 64, 128}. Work items (chunk, KV head, up to 16 rows) are dealt to the threads round-robin in
// order of cost, so causal rows of unequal length still split evenly.
void paged_prefill(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor block_tables,
                   torch::Tensor row_starts, torch::Tensor first_pos, double scale, torch::Tensor out) {
  TORCH_CHECK(q.dtype() == torch::kFloat && k_cache.dtype() == torch::kFloat && v_cache.dtype() == torch::kFloat
              && out.dtype() == torch::kFloat, "paged_prefill: fp32 only");
  TORCH_CHECK(q.is_contiguous() && out.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous()
              && block_tables.is_contiguous() && row_starts.is_contiguous() && first_pos.is_contiguous(),
              "paged_prefill: contiguous inputs");
  TORCH_CHECK(block_tables.dtype() == torch::kLong && row_starts.dtype() == torch::kLong
              && first_pos.dtype() == torch::kLong, "paged_prefill: int64 tables, row starts and positions");
  const int64_t H = q.size(1), D = q.size(2), bs = k_cache.size(1), KVH = k_cache.size(2);
  const int64_t P = block_tables.size(0), max_blocks = block_tables.size(1);
  TORCH_CHECK(k_cache.size(3) == D && H % KVH == 0 && bs == 16 && (D == 16 || D == 32 || D == 64 || D == 128)
              && row_starts.size(0) == P + 1 && first_pos.size(0) == P, "paged_prefill: shape mismatch");
  const int64_t G = H / KVH, tok_stride = KVH * D, blk_stride = bs * KVH * D;
  const int64_t* rs = row_starts.data_ptr<int64_t>();
  const int64_t* fp = first_pos.data_ptr<int64_t>();
  const int64_t* tp = block_tables.data_ptr<int64_t>();
  struct Item { int64_t p, h, r0, nr, cost; };
  std::vector<Item> items;
  for (int64_t p = 0; p < P; ++p)
    for (int64_t r = rs[p]; r < rs[p + 1]; r += 16) {
      const int64_t nr = std::min<int64_t>(16, rs[p + 1] - r);
      for (int64_t h = 0; h < KVH; ++h) items.push_back({p, h, r, nr, nr * (fp[p] + r - rs[p] + nr)});
    }
  std::sort(items.begin(), items.end(), [](const Item& a, const Item& b) { return a.cost > b.cost; });
  const float* qp = q.data_ptr<float>();
  const float* kp = k_cache.data_ptr<float>();
  const float* vp = v_cache.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float sc = static_cast<float>(scale);
  const int64_t workers = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), items.size()));
  int64_t max_ctx = 16;
  for (int64_t p = 0; p < P; ++p) max_ctx = std::max(max_ctx, fp[p] + rs[p + 1] - rs[p]);
  at::parallel_for(0, workers, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> kt((max_ctx + 15) / 16 * 16 * D);  // the item's keys, transposed block by block
    for (int64_t w = begin; w < end; ++w)
      for (size_t k = w; k < items.size(); k += workers) {
        const Item& it = items[k];
        const int64_t first = fp[it.p] + (it.r0 - rs[it.p]);
        const float* qr = qp + it.r0 * H * D;
        float* orow = op + it.r0 * H * D;
        const int64_t* tab = tp + it.p * max_blocks;
#define PREFILL_TILE(DIM) \
  prefill_tile<DIM>(qr, H * D, kp, vp, tab, first, it.nr, G, it.h, tok_stride, blk_stride, sc, orow, kt.data())
        if (D == 64) PREFILL_TILE(64);
        else if (D == 128) PREFILL_TILE(128);
        else if (D == 32) PREFILL_TILE(32);
        else PREFILL_TILE(16);
#undef PREFILL_TILE
      }
  });
}

// Rotary embedding of the q and k heads of a fused qkv [T, W] row (HF rotate_half convention):
// q_out [T, nq, D], k_out [T, nk, D]; cos/sin [P, D] tables indexed by positions [T].
void rope(torch::Tensor qkv, torch::Tensor positions, torch::Tensor cos, torch::Tensor sin, int64_t nq,
          int64_t nk, torch::Tensor q_out, torch::Tensor k_out) {
  TORCH_CHECK(qkv.dtype() == torch::kFloat && cos.dtype() == torch::kFloat && sin.dtype() == torch::kFloat
              && q_out.dtype() == torch::kFloat && k_out.dtype() == torch::kFloat, "rope: fp32 only");
  TORCH_CHECK(qkv.is_contiguous() && cos.is_contiguous() && sin.is_contiguous() && q_out.is_contiguous()
              && k_out.is_contiguous() && positions.is_contiguous() && positions.dtype() == torch::kLong,
              "rope: contiguous inputs, int64 positions");
  const int64_t T = qkv.size(0), W = qkv.size(1), D = q_out.size(2), half = D / 2;
  TORCH_CHECK(W >= (nq + nk) * D && cos.size(-1) == D && D % 2 == 0, "rope: shape mismatch");
  const float* xp = qkv.data_ptr<float>();
  const int64_t* pp = positions.data_ptr<int64_t>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  float* qo = q_out.data_ptr<float>();
  float* ko = k_out.data_ptr<float>();
  at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* c = cp + pp[t] * D;
      const float* s = sp + pp[t] * D;
      for (int64_t h = 0; h < nq + nk; ++h) {
        const float* x = xp + t * W + h * D;
        float* o = h < nq ? qo + (t * nq + h) * D : ko + (t * nk + h - nq) * D;
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) o[i] = x[i] * c[i] - x[i + half] * s[i];
#pragma omp simd
        for (int64_t i = half; i < D; ++i) o[i] = x[i] * c[i] + x[i - half] * s[i];
      }
    }
  });
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", torch::wrap_pybind_function(paged_decode), "paged_decode");
  m.def("paged_prefill", torch::wrap_pybind_function(paged_prefill), "paged_prefill");
  m.def("add_rms_norm", torch::wrap_pybind_function(add_rms_norm), "add_rms_norm");
  m.def("rope", torch::wrap_pybind_function(rope), "rope");
  m.def("silu_mul", torch::wrap_pybind_function(silu_mul), "silu_mul");
}
