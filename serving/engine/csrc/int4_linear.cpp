// Weight-only 4-bit linear layers on CPU (built by serving/engine/int4_linear.py, whose docstring describes the
// storage and the two paths): int4_linear.
// torch's types, its error translation and pybind11 casters, not all of <torch/extension.h>: 27 s of compile, not 54
#include <torch/types.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/utils/pybind.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

// `Pair`: the 16 codes of one column pair as fp32 (k: low nibbles, k+1: high nibbles); `Acc` sums code * x for one
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

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("int4_linear", torch::wrap_pybind_function(int4_linear), "int4_linear");
}
