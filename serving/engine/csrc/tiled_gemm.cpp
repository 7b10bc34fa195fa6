// fp32 y = x @ w.T over a weight packed in 8-column tiles (serving/engine/linear_backend.py says why and where).
//
// Layout (tiled_pack): w [N, K] becomes [T, K, 8] with T = ceil(N / 16) * 2 tiles, tile t holding output columns
// 8t..8t+7 for every k, zero-padded past N. A tile is one contiguous stream, so a decode step reads each weight
// once, front to back, in the order the hardware prefetcher expects.
//
// Two paths over the same tiles, picked by the number of activation rows M:
// - M == 1 (batch-1 decode): four tiles at once, four independent accumulators, x[k] broadcast once per k: four
//   sequential streams and nothing else, so the pace is the memory's.
// - M > 1: two adjacent tiles (16 columns) times up to 6 rows, 12 accumulators in registers (GCC spilled an array of
//   __m256 to the stack on every iteration, 2x slower, so the accumulators are named), K in blocks of KC so the
//   rows' slice of x stays in L1; work items are (block of MC rows) x (tile pair), dealt over the threads. From
//   PANEL_ROWS rows on, x is first copied into panels of 6 rows, so a register block broadcasts from one stream.
//   While a block computes, it prefetches the next K block's weights into L2 (struct Prefetch says why).
// AVX2 + FMA only (the flags -march=native gives where the host has them); elsewhere tiled_gemm_available() is
// false and the engine keeps its GEMM library.
#include "cpu_kernels.h"
#include <ATen/Parallel.h>
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define TILED_GEMM 1
#else
#define TILED_GEMM 0
#endif

namespace {

constexpr int64_t TILE = 8;    // output columns per tile: one 8-lane vector
constexpr int64_t KC = 256;    // input columns per block of the M > 1 path
constexpr int64_t MC = 96;     // activation rows per work item of the M > 1 path
constexpr int64_t ROWS = 6;    // rows per register block
constexpr int64_t PANEL_ROWS = 24;  // from this many rows on, x is packed into panels first

#if TILED_GEMM
// One row, four tiles (32 columns) from t0: y[0, 8*t0 ..] = x . tiles.
inline void row_x4(const float* x, int64_t K, const float* w, float* y) {
  const float* w0 = w; const float* w1 = w0 + K * TILE; const float* w2 = w1 + K * TILE; const float* w3 = w2 + K * TILE;
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  for (int64_t k = 0; k < K; ++k) {
    const __m256 xv = _mm256_broadcast_ss(x + k);
    a0 = _mm256_fmadd_ps(_mm256_loadu_ps(w0 + k * TILE), xv, a0);
    a1 = _mm256_fmadd_ps(_mm256_loadu_ps(w1 + k * TILE), xv, a1);
    a2 = _mm256_fmadd_ps(_mm256_loadu_ps(w2 + k * TILE), xv, a2);
    a3 = _mm256_fmadd_ps(_mm256_loadu_ps(w3 + k * TILE), xv, a3);
  }
  _mm256_storeu_ps(y, a0); _mm256_storeu_ps(y + 8, a1); _mm256_storeu_ps(y + 16, a2); _mm256_storeu_ps(y + 24, a3);
}

// What one register block fetches into L2 while it computes: its share of the next K block's weights, spread
// evenly over its k loop. Without it, a step of 16 rows (three passes of up to 6 rows over each block) read memory
// only during the first pass and waited for it in the others: memory time and compute time added up (16 rows,
// gate/up, weights from DRAM: 670 us, against 393 us with the weights in cache and 304 us for one row).
struct Prefetch {
  const float* t0 = nullptr;  // the next K block of tile 0 and tile 1 (null: nothing to fetch)
  const float* t1 = nullptr;
  int64_t first = 0, last = 0;  // cache lines [first, last) of that block, alternating tile 0 and tile 1
  int64_t every = 1;            // one line every this many k
};

// R (<= 6) rows of x times kc columns of two tiles into y (stride ldy, 16 columns): y = (ACC ? y : 0) + x w. x is
// row-major with stride ldx, or (PANEL) a packed panel: x[k * 6 + i], one stream however many rows. Meanwhile it
// prefetches pf's lines.
template <int R, bool ACC, bool PANEL>
inline void block_2x(const float* x, int64_t ldx, int64_t kc, const float* w0, const float* w1, float* y, int64_t ldy,
                     Prefetch pf = Prefetch()) {
  int64_t next_k = pf.t0 ? 0 : kc, line = pf.first;
  __m256 a0, a1, a2, a3, a4, a5, b0, b1, b2, b3, b4, b5;
#define TG_INIT(i) if (R > i) { \
    if (ACC) { a##i = _mm256_loadu_ps(y + i * ldy); b##i = _mm256_loadu_ps(y + i * ldy + 8); } \
    else { a##i = _mm256_setzero_ps(); b##i = _mm256_setzero_ps(); } }
  TG_INIT(0) TG_INIT(1) TG_INIT(2) TG_INIT(3) TG_INIT(4) TG_INIT(5)
#undef TG_INIT
  // unrolled by two: 4-11% less time from 8 to 512 rows, weights from memory (AMD EPYC, AVX2)
#pragma GCC unroll 2
  for (int64_t k = 0; k < kc; ++k) {
    if (k == next_k) {
      if (line < pf.last) {
        _mm_prefetch(reinterpret_cast<const char*>(((line & 1) ? pf.t1 : pf.t0) + (line >> 1) * 16), _MM_HINT_T1);
        ++line; next_k += pf.every;
      } else {
        next_k = kc;
      }
    }
    const __m256 v0 = _mm256_loadu_ps(w0 + k * TILE), v1 = _mm256_loadu_ps(w1 + k * TILE);
    __m256 xv;
#define TG_FMA(i) if (R > i) { xv = _mm256_broadcast_ss(PANEL ? x + k * ROWS + i : x + i * ldx + k); \
    a##i = _mm256_fmadd_ps(xv, v0, a##i); b##i = _mm256_fmadd_ps(xv, v1, b##i); }
    TG_FMA(0) TG_FMA(1) TG_FMA(2) TG_FMA(3) TG_FMA(4) TG_FMA(5)
#undef TG_FMA
  }
#define TG_STORE(i) if (R > i) { _mm256_storeu_ps(y + i * ldy, a##i); _mm256_storeu_ps(y + i * ldy + 8, b##i); }
  TG_STORE(0) TG_STORE(1) TG_STORE(2) TG_STORE(3) TG_STORE(4) TG_STORE(5)
#undef TG_STORE
}

// ``rows`` rows from x (row-major, stride ldx; or PANEL: panels of 6 rows, each 6 * ldx floats, x pointing at
// column k0 of the first) through one K block of a tile pair.
template <bool ACC, bool PANEL>
inline void rows_2x(const float* x, int64_t ldx, int64_t rows, int64_t kc, const float* w0, const float* w1, float* y,
                    int64_t ldy, const float* next0 = nullptr, const float* next1 = nullptr, int64_t next_kc = 0) {
  const int64_t passes = (rows + ROWS - 1) / ROWS, lines = 2 * ((next_kc + 1) / 2);
  const int64_t per_pass = (lines + passes - 1) / passes;
  for (int64_t r = 0, pass = 0; r < rows; r += ROWS, ++pass) {
    const float* xr = x + r * ldx;  // r rows on, in either layout (a panel of 6 rows holds 6 * ldx floats)
    float* yr = y + r * ldy;
    Prefetch pf;
    if (next0 && per_pass > 0) {
      pf.t0 = next0; pf.t1 = next1; pf.first = pass * per_pass; pf.last = std::min(lines, pf.first + per_pass);
      pf.every = std::max<int64_t>(1, kc / per_pass);
    }
    switch (std::min(ROWS, rows - r)) {
      case 1: block_2x<1, ACC, PANEL>(xr, ldx, kc, w0, w1, yr, ldy, pf); break;
      case 2: block_2x<2, ACC, PANEL>(xr, ldx, kc, w0, w1, yr, ldy, pf); break;
      case 3: block_2x<3, ACC, PANEL>(xr, ldx, kc, w0, w1, yr, ldy, pf); break;
      case 4: block_2x<4, ACC, PANEL>(xr, ldx, kc, w0, w1, yr, ldy, pf); break;
      case 5: block_2x<5, ACC, PANEL>(xr, ldx, kc, w0, w1, yr, ldy, pf); break;
      default: block_2x<6, ACC, PANEL>(xr, ldx, kc, w0, w1, yr, ldy, pf); break;
    }
  }
}

// Copy the valid columns of a padded [rows, ldp] scratch block into y [rows, N] from column c0.
inline void copy_cols(const float* src, int64_t ldp, int64_t rows, float* y, int64_t N, int64_t c0, int64_t cols) {
  for (int64_t r = 0; r < rows; ++r) std::memcpy(y + r * N + c0, src + r * ldp, cols * sizeof(float));
}
#endif

}  // namespace

bool tiled_gemm_available() { return TILED_GEMM != 0; }

// w [N, K] fp32 -> tiles [T, K, 8], T = ceil(N / 16) * 2, zero-padded columns.
torch::Tensor tiled_pack(torch::Tensor w) {
  TORCH_CHECK(w.dtype() == torch::kFloat && w.dim() == 2 && w.device().is_cpu(), "tiled_pack: fp32 CPU [N, K]");
  const int64_t N = w.size(0), K = w.size(1), T = (N + 2 * TILE - 1) / (2 * TILE) * 2;
  auto padded = torch::zeros({T * TILE, K}, w.options());
  padded.narrow(0, 0, N).copy_(w);
  return padded.view({T, TILE, K}).transpose(1, 2).contiguous();
}

// x [M, K] fp32 contiguous, tiles from tiled_pack, out [M, N] contiguous (N <= T * 8): out = x @ w.T.
void tiled_linear(torch::Tensor x, torch::Tensor tiles, torch::Tensor out) {
  TORCH_CHECK(TILED_GEMM, "tiled_linear: built without AVX2 + FMA");
  TORCH_CHECK(x.dtype() == torch::kFloat && tiles.dtype() == torch::kFloat && out.dtype() == torch::kFloat,
              "tiled_linear: fp32 only");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && tiles.dim() == 3 && tiles.is_contiguous() && tiles.size(2) == TILE
              && out.dim() == 2 && out.is_contiguous(), "tiled_linear: contiguous x [M, K], tiles [T, K, 8], out [M, N]");
  const int64_t M = x.size(0), K = x.size(1), T = tiles.size(0), N = out.size(1);
  TORCH_CHECK(tiles.size(1) == K && out.size(0) == M && N <= T * TILE && N > (T - 2) * TILE && T % 2 == 0,
              "tiled_linear: shape mismatch");
#if TILED_GEMM
  const float* xp = x.data_ptr<float>();
  const float* wp = tiles.data_ptr<float>();
  float* yp = out.data_ptr<float>();
  const int64_t tile_floats = K * TILE;
  if (M == 1) {
    // groups of four tiles; the last group may hold two (T is even) and may run past N: computed into scratch
    const int64_t groups = (T + 3) / 4;
    at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
      alignas(32) float scratch[4 * TILE];
      for (int64_t g = begin; g < end; ++g) {
        const int64_t c0 = g * 4 * TILE, cols = std::min<int64_t>(4 * TILE, N - c0);
        const float* w = wp + g * 4 * tile_floats;
        if (4 * (g + 1) <= T && cols == 4 * TILE) { row_x4(xp, K, w, yp + c0); continue; }
        if (4 * (g + 1) <= T) { row_x4(xp, K, w, scratch); }
        else { rows_2x<false, false>(xp, K, 1, K, w, w + tile_floats, scratch, 2 * TILE); }
        copy_cols(scratch, 4 * TILE, 1, yp, N, c0, cols);
      }
    });
    return;
  }
  // From PANEL_ROWS rows on, x is first copied into panels of 6 rows ([M / 6][K][6]): each register block then
  // broadcasts from one sequential stream instead of six rows K apart.
  const bool panel = M >= PANEL_ROWS;
  // The panels' buffer lives across calls (one per calling thread, grown, never shrunk): a fresh vector per call
  // cost an allocation, page faults and a zero fill of up to a few MB for every projection of a prefill step.
  thread_local std::vector<float> panels;
  if (panel) {
    const int64_t np = (M + ROWS - 1) / ROWS;
    if (static_cast<int64_t>(panels.size()) < np * ROWS * K) panels.resize(np * ROWS * K);
    float* pp = panels.data();
    at::parallel_for(0, np, 1, [&](int64_t begin, int64_t end) {
      for (int64_t b = begin; b < end; ++b) {
        const int64_t rows = std::min(ROWS, M - b * ROWS);
        float* dst = pp + b * ROWS * K;
        for (int64_t k = 0; k < K; ++k)
          for (int64_t i = 0; i < ROWS; ++i) dst[k * ROWS + i] = i < rows ? xp[(b * ROWS + i) * K + k] : 0.f;
      }
    });
  }
  const float* pp = panels.data();
  const int64_t pairs = T / 2, row_blocks = (M + MC - 1) / MC;
  at::parallel_for(0, pairs * row_blocks, 1, [&](int64_t begin, int64_t end) {
    alignas(32) float scratch[MC * 2 * TILE];
    for (int64_t item = begin; item < end; ++item) {
      const int64_t p = item % pairs, m0 = item / pairs * MC, rows = std::min(MC, M - m0);
      const int64_t c0 = p * 2 * TILE, cols = std::min<int64_t>(2 * TILE, N - c0);
      const float* w0 = wp + 2 * p * tile_floats;
      const float* w1 = w0 + tile_floats;
      const bool full = cols == 2 * TILE;
      float* y = full ? yp + m0 * N + c0 : scratch;
      const int64_t ldy = full ? N : 2 * TILE;
      for (int64_t k0 = 0; k0 < K; k0 += KC) {
        const int64_t kc = std::min(KC, K - k0);
        const float* w0k = w0 + k0 * TILE;
        const float* w1k = w1 + k0 * TILE;
        // the weights of the next K block (this pair's, else the next item's first) are fetched into L2 while
        // this one computes, so the memory keeps streaming through the passes over rows
        const float *n0 = nullptr, *n1 = nullptr;
        int64_t nkc = 0;
        if (k0 + KC < K) { n0 = w0k + KC * TILE; n1 = w1k + KC * TILE; nkc = std::min(KC, K - k0 - KC); }
        else if (item + 1 < end) {
          n0 = wp + 2 * ((item + 1) % pairs) * tile_floats; n1 = n0 + tile_floats; nkc = std::min(KC, K);
        }
        if (panel) {
          const float* xk = pp + m0 * K + k0 * ROWS;  // m0 is a multiple of 6: panel m0 / 6, column k0
          if (k0 == 0) rows_2x<false, true>(xk, K, rows, kc, w0k, w1k, y, ldy, n0, n1, nkc);
          else rows_2x<true, true>(xk, K, rows, kc, w0k, w1k, y, ldy, n0, n1, nkc);
        } else {
          const float* xk = xp + m0 * K + k0;
          if (k0 == 0) rows_2x<false, false>(xk, K, rows, kc, w0k, w1k, y, ldy, n0, n1, nkc);
          else rows_2x<true, false>(xk, K, rows, kc, w0k, w1k, y, ldy, n0, n1, nkc);
        }
      }
      if (!full) copy_cols(scratch, 2 * TILE, rows, yp + m0 * N, N, c0, cols);
    }
  });
#endif
}
