// The one-pass row kernels of the fp32 path: add_rms_norm (residual add + RMSNorm), silu_mul (the gated MLP's
// middle) and rope (rotary embedding of q and k) (serving/engine/cpu_kernels.py describes them).
#include "cpu_kernels.h"
#include "vec16.h"
#include <ATen/Parallel.h>
#include <cmath>
#include <cstdint>

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

// silu(x) * u on the lanes of one GCC float vector V (VI: its int32 twin).
template <typename V, typename VI>
inline V silu_times(V x, V u) {
  const V e = exp_lanes<V, VI>(x < 0.f ? x : -x);
  return x * ((x >= 0.f ? (V){} + 1.f : e) / (1.f + e)) * u;
}

// The SiLU-gated MLP's middle: out [T, I] = silu(gu[:, :I]) * gu[:, I:] for a fused gate/up projection gu [T, 2I]
// (one pass instead of chunk, silu and mul as three ops with two temporaries). silu(x) = x * sigmoid(x), the
// sigmoid from e = exp(-|x|) so the exponential never overflows: 1 / (1 + e) for x >= 0, e / (1 + e) below.
void silu_mul(torch::Tensor gu, torch::Tensor out) {
  TORCH_CHECK(gu.dtype() == torch::kFloat && out.dtype() == torch::kFloat && gu.is_contiguous()
              && out.is_contiguous() && gu.dim() == 2 && out.dim() == 2 && gu.size(0) == out.size(0)
              && gu.size(1) == 2 * out.size(1), "silu_mul: contiguous fp32 gu [T, 2I], out [T, I]");
  // the native vector width (16-lane vector code on AVX2 ran 7x slower)
  constexpr int64_t L = NAT_LANES;
  const int64_t T = out.size(0), I = out.size(1), IV = I / L * L;
  const float* gp = gu.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, T, 4, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* g = gp + t * 2 * I;
      const float* u = g + I;
      float* o = op + t * I;
      for (int64_t i = 0; i < IV; i += L) {
        store_nat(o + i, silu_times<vnat, vnati>(load_nat(g + i), load_nat(u + i)));
      }
      for (int64_t i = IV; i < I; ++i) {
        const float x = g[i], e = exp_nonpos(-std::fabs(x));
        o[i] = x * ((x >= 0.f ? 1.f : e) / (1.f + e)) * u[i];
      }
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
