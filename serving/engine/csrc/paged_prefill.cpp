// Causal attention of prefill and speculative-verify chunks straight from the paged KV cache: paged_prefill
// (serving/engine/cpu_kernels.py describes it).
#include "cpu_kernels.h"
#include "vec16.h"
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace {

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
