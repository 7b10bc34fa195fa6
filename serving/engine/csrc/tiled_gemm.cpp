// fp32 y = x @ w.T over a weight packed in column tiles (serving/engine/linear_backend.py says why and where).
//
// Layout (tiled_pack): w [N, K] becomes [T, K, TILE] with T = ceil(N / (2 * TILE)) * 2 tiles, tile t holding output
// columns TILE*t .. TILE*t + TILE-1 for every k, zero-padded past N. TILE is one vector register's lanes: 16 where
// the build has AVX-512, 8 with AVX2. A tile is one contiguous stream, so a decode step reads each weight once,
// front to back, in the order the hardware prefetcher expects.
//
// Two paths over the same tiles, picked by the number of activation rows M:
// - M == 1 (batch-1 decode): four tiles at once, four independent accumulators, x[k] broadcast once per k: four
//   sequential streams and nothing else, so the pace is the memory's. On AVX-512 each k reads one whole cache line
//   per stream (16 lanes): 0.87x the time of the 8-lane tiles over one decode step's projections (AMD Zen 4).
// - M > 1: two adjacent tiles times up to ROWS rows (6 with 16 vector registers, 12 with AVX-512's 32), 2 * ROWS
//   accumulators in registers (GCC spilled an array of vectors to the stack on every iteration, 2x slower, so the
//   accumulators are named), K in blocks of KC so the rows' slice of x stays in L1; work items are (block of MC
//   rows) x (tile pair), dealt over the threads. Below PANEL_ROWS rows, the rows are split into passes of equal
//   size (16 rows on AVX-512: 8 + 8, not 12 + 4); from PANEL_ROWS rows on, x is first copied into panels of ROWS
//   rows, so a register block broadcasts from one stream. While a block computes, it prefetches the next K
//   block's weights into L2 (struct Prefetch says why).
// The vector width is the build's (-march=native); without AVX2 + FMA tiled_gemm_available() is false and the
// engine keeps its GEMM library. The macros below give the two widths one source.
#include "cpu_kernels.h"
#include <ATen/Parallel.h>
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#define TILED_GEMM 1
using Vec = __m512;
#define V_LANES 16
#define V_ROWS 12
#define V_ZERO() _mm512_setzero_ps()
#define V_LOAD(p) _mm512_loadu_ps(p)
#define V_STORE(p, v) _mm512_storeu_ps(p, v)
#define V_SET1(p) _mm512_set1_ps(*(p))
#define V_FMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define TILED_GEMM 1
using Vec = __m256;
#define V_LANES 8
#define V_ROWS 6
#define V_ZERO() _mm256_setzero_ps()
#define V_LOAD(p) _mm256_loadu_ps(p)
#define V_STORE(p, v) _mm256_storeu_ps(p, v)
#define V_SET1(p) _mm256_broadcast_ss(p)
#define V_FMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#else
#define TILED_GEMM 0
#define V_LANES 8
#define V_ROWS 6
#endif

namespace {

constexpr int64_t TILE = V_LANES;  // output columns per tile: one vector
constexpr int64_t KC = 256;        // input columns per block of the M > 1 path
constexpr int64_t MC = 96;         // activation rows per work item of the M > 1 path (a multiple of ROWS)
constexpr int64_t ROWS = V_ROWS;   // rows per register block: 2 * ROWS accumulators, with room for the weights
constexpr int64_t PANEL_ROWS = 24;  // from this many rows on, x is packed into panels first

#if TILED_GEMM
// One row, four tiles from t0: y[0, TILE*t0 ..] = x . tiles.
inline void row_x4(const float* x, int64_t K, const float* w, float* y) {
  const float* w0 = w; const float* w1 = w0 + K * TILE; const float* w2 = w1 + K * TILE; const float* w3 = w2 + K * TILE;
  Vec a0 = V_ZERO(), a1 = a0, a2 = a0, a3 = a0;
  for (int64_t k = 0; k < K; ++k) {
    const Vec xv = V_SET1(x + k);
    a0 = V_FMA(V_LOAD(w0 + k * TILE), xv, a0);
    a1 = V_FMA(V_LOAD(w1 + k * TILE), xv, a1);
    a2 = V_FMA(V_LOAD(w2 + k * TILE), xv, a2);
    a3 = V_FMA(V_LOAD(w3 + k * TILE), xv, a3);
  }
  V_STORE(y, a0); V_STORE(y + TILE, a1); V_STORE(y + 2 * TILE, a2); V_STORE(y + 3 * TILE, a3);
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

// R (<= ROWS) rows of x times kc columns of two tiles into y (stride ldy, 2 * TILE columns): y = (ACC ? y : 0) + x w.
// x is row-major with stride ldx, or (PANEL) a packed panel: x[k * ROWS + i], one stream however many rows.
// Meanwhile it prefetches pf's lines.
template <int R, bool ACC, bool PANEL>
inline void block_2x(const float* x, int64_t ldx, int64_t kc, const float* w0, const float* w1, float* y, int64_t ldy,
                     Prefetch pf = Prefetch()) {
  static_assert(R >= 1 && R <= ROWS, "a register block holds at most ROWS rows");
  int64_t next_k = pf.t0 ? 0 : kc, line = pf.first;
  Vec a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, b0, b1, b2, b3, b4, b5, b6, b7, b8, b9, b10, b11;
#define TG_INIT(i) if constexpr (R > i) { \
    if (ACC) { a##i = V_LOAD(y + i * ldy); b##i = V_LOAD(y + i * ldy + TILE); } \
    else { a##i = V_ZERO(); b##i = V_ZERO(); } }
  TG_INIT(0) TG_INIT(1) TG_INIT(2) TG_INIT(3) TG_INIT(4) TG_INIT(5)
  TG_INIT(6) TG_INIT(7) TG_INIT(8) TG_INIT(9) TG_INIT(10) TG_INIT(11)
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
    const Vec v0 = V_LOAD(w0 + k * TILE), v1 = V_LOAD(w1 + k * TILE);
    Vec xv;
#define TG_FMA(i) if constexpr (R > i) { xv = V_SET1(PANEL ? x + k * ROWS + i : x + i * ldx + k); \
    a##i = V_FMA(xv, v0, a##i); b##i = V_FMA(xv, v1, b##i); }
    TG_FMA(0) TG_FMA(1) TG_FMA(2) TG_FMA(3) TG_FMA(4) TG_FMA(5)
    TG_FMA(6) TG_FMA(7) TG_FMA(8) TG_FMA(9) TG_FMA(10) TG_FMA(11)
#undef TG_FMA
  }
#define TG_STORE(i) if constexpr (R > i) { V_STORE(y + i * ldy, a##i); V_STORE(y + i * ldy + TILE, b##i); }
  TG_STORE(0) TG_STORE(1) TG_STORE(2) TG_STORE(3) TG_STORE(4) TG_STORE(5)
  TG_STORE(6) TG_STORE(7) TG_STORE(8) TG_STORE(9) TG_STORE(10) TG_STORE(11)
#undef TG_STORE
}

// block_2x for a row count known only at run time (1 .. ROWS).
template <bool ACC, bool PANEL, int R = ROWS>
inline void block_2x_rows(int64_t rows, const float* x, int64_t ldx, int64_t kc, const float* w0, const float* w1,
                          float* y, int64_t ldy, Prefetch pf) {
  if constexpr (R > 1) {
    if (rows < R) return block_2x_rows<ACC, PANEL, R - 1>(rows, x, ldx, kc, w0, w1, y, ldy, pf);
  }
  block_2x<R, ACC, PANEL>(x, ldx, kc, w0, w1, y, ldy, pf);
}

// ``rows`` rows from x (row-major, stride ldx; or PANEL: panels of ROWS rows, each ROWS * ldx floats, x pointing at
// column k0 of the first) through one K block of a tile pair. Row-major rows go in passes of equal size; panels go
// a panel per pass.
template <bool ACC, bool PANEL>
inline void rows_2x(const float* x, int64_t ldx, int64_t rows, int64_t kc, const float* w0, const float* w1, float* y,
                    int64_t ldy, const float* next0 = nullptr, const float* next1 = nullptr, int64_t next_kc = 0) {
  const int64_t passes = (rows + ROWS - 1) / ROWS, per_block = PANEL ? ROWS : (rows + passes - 1) / passes;
  const int64_t lines = 2 * ((next_kc * TILE + 15) / 16);  // cache lines of the next K block, both tiles
  const int64_t per_pass = (lines + passes - 1) / passes;
  for (int64_t r = 0, pass = 0; r < rows; r += per_block, ++pass) {
    const float* xr = x + r * ldx;  // r rows on, in either layout (a panel of ROWS rows holds ROWS * ldx floats)
    float* yr = y + r * ldy;
    Prefetch pf;
    if (next0 && per_pass > 0) {
      pf.t0 = next0; pf.t1 = next1; pf.first = pass * per_pass; pf.last = std::min(lines, pf.first + per_pass);
      pf.every = std::max<int64_t>(1, kc / per_pass);
    }
    block_2x_rows<ACC, PANEL>(std::min(per_block, rows - r), xr, ldx, kc, w0, w1, yr, ldy, pf);
  }
}

// Copy the valid columns of a padded [rows, ldp] scratch block into y [rows, N] from column c0.
inline void copy_cols(const float* src, int64_t ldp, int64_t rows, float* y, int64_t N, int64_t c0, int64_t cols) {
  for (int64_t r = 0; r < rows; ++r) std::memcpy(y + r * N + c0, src + r * ldp, cols * sizeof(float));
}
#endif

}  // namespace

bool tiled_gemm_available() { return TILED_GEMM != 0; }

// w [N, K] fp32 -> tiles [T, K, TILE], T = ceil(N / (2 * TILE)) * 2, zero-padded columns.
torch::Tensor tiled_pack(torch::Tensor w) {
  TORCH_CHECK(w.dtype() == torch::kFloat && w.dim() == 2 && w.device().is_cpu(), "tiled_pack: fp32 CPU [N, K]");
  const int64_t N = w.size(0), K = w.size(1), T = (N + 2 * TILE - 1) / (2 * TILE) * 2;
  auto padded = torch::zeros({T * TILE, K}, w.options());
  padded.narrow(0, 0, N).copy_(w);
  return padded.view({T, TILE, K}).transpose(1, 2).contiguous();
}

// x [M, K] fp32 contiguous, tiles from tiled_pack, out [M, N] contiguous (N <= T * TILE): out = x @ w.T.
void tiled_linear(torch::Tensor x, torch::Tensor tiles, torch::Tensor out) {
  TORCH_CHECK(TILED_GEMM, "tiled_linear: built without AVX2 + FMA");
  TORCH_CHECK(x.dtype() == torch::kFloat && tiles.dtype() == torch::kFloat && out.dtype() == torch::kFloat,
              "tiled_linear: fp32 only");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && tiles.dim() == 3 && tiles.is_contiguous() && tiles.size(2) == TILE
              && out.dim() == 2 && out.is_contiguous(),
              "tiled_linear: contiguous x [M, K], tiles [T, K, TILE] from this build's tiled_pack, out [M, N]");
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
      alignas(64) float scratch[4 * TILE];
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
  // From PANEL_ROWS rows on, x is first copied into panels of ROWS rows ([M / ROWS][K][ROWS]): each register block
  // then broadcasts from one sequential stream instead of ROWS rows K apart.
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
    alignas(64) float scratch[MC * 2 * TILE];
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
          const float* xk = pp + m0 * K + k0 * ROWS;  // m0 is a multiple of ROWS: panel m0 / ROWS, column k0
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
