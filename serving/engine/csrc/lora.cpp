// lora_add: the LoRA step of one fused projection for every row of a step in one call (serving/engine/lora.py).
// For each row t whose slot s = row_slots[t] >= 0:  z = A[s] x_t  (K = parts * rank values), then for each part p
// (out_offset, out_size, k_offset):  out[t, off : off + size] += sum over r < rank of z[k_off + r] * Bt[s, k_off + r,
// off : off + size]. A [S, K, In] and Bt [S, K, N] (B transposed: each rank's column of B is a contiguous row, so
// the expand is `rank` vector multiply-adds over the part's outputs, no horizontal sums) are the resident adapters'
// stacked weights; B is block-diagonal by parts, and only each part's own block is read. In torch this was two small
// matmuls and an add per adapter per projection: ~100 ops a layer with 8 adapters in a batch, most of a step in
// dispatch.
#include "cpu_kernels.h"
#include "vec16.h"
#include <ATen/Parallel.h>
#include <cstdint>
#include <vector>

namespace {

inline float dot(const float* a, const float* b, int64_t n) {
  const int64_t nv = n / 16 * 16;
  v16 acc = {};
  for (int64_t i = 0; i < nv; i += 16) acc += load16(a + i) * load16(b + i);
  float s = hsum16(acc);
  for (int64_t i = nv; i < n; ++i) s += a[i] * b[i];
  return s;
}

// y[0:n] += a * x[0:n]
inline void axpy(float* y, const float* x, float a, int64_t n) {
  const int64_t nv = n / 16 * 16;
  for (int64_t i = 0; i < nv; i += 16) store16(y + i, load16(y + i) + a * load16(x + i));
  for (int64_t i = nv; i < n; ++i) y[i] += a * x[i];
}

}  // namespace

void lora_add(torch::Tensor out, torch::Tensor x, torch::Tensor A, torch::Tensor B, torch::Tensor row_slots,
              torch::Tensor parts, int64_t rank) {
  TORCH_CHECK(out.dtype() == torch::kFloat && x.dtype() == torch::kFloat && A.dtype() == torch::kFloat
              && B.dtype() == torch::kFloat, "lora_add: fp32 only");
  TORCH_CHECK(out.dim() == 2 && x.dim() == 2 && A.dim() == 3 && B.dim() == 3 && out.stride(1) == 1
              && x.stride(1) == 1 && A.is_contiguous() && B.is_contiguous(), "lora_add: row-major out, x; contiguous A, B");
  TORCH_CHECK(row_slots.dtype() == torch::kLong && row_slots.numel() == x.size(0) && x.size(0) == out.size(0)
              && parts.dtype() == torch::kLong && parts.dim() == 2 && parts.size(1) == 3, "lora_add: shapes");
  const int64_t T = x.size(0), In = x.size(1), K = A.size(1), N = B.size(2);
  TORCH_CHECK(A.size(2) == In && B.size(1) == K && out.size(1) == N, "lora_add: A [S, K, In], Bt [S, K, N]");
  const float* xp = x.data_ptr<float>();
  const float* ap = A.data_ptr<float>();
  const float* bp = B.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t* slots = row_slots.data_ptr<int64_t>();
  const int64_t* pp = parts.data_ptr<int64_t>();
  const int64_t P = parts.size(0), xs = x.stride(0), os = out.stride(0);
  at::parallel_for(0, T, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> z(K);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t s = slots[t];
      if (s < 0) continue;
      const float* xr = xp + t * xs;
      const float* a = ap + s * K * In;
      for (int64_t k = 0; k < K; ++k) z[k] = dot(a + k * In, xr, In);
      const float* b = bp + s * K * N;
      float* orow = op + t * os;
      for (int64_t p = 0; p < P; ++p) {
        const int64_t off = pp[3 * p], size = pp[3 * p + 1], koff = pp[3 * p + 2];
        for (int64_t r = koff; r < koff + rank; ++r) {
          if (z[r] != 0.f) axpy(orow + off, b + r * N + off, z[r], size);
        }
      }
    }
  });
}
