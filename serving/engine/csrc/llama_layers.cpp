// Every decoder layer of a Llama-shaped model on the CPU fp32 kernel path, in one call from Python
// (serving/engine/compact_llama.py says when it is taken).
//
// Why: the layer loop in Python made ~30 calls a layer into torch and these kernels (views, new_empty, the KV
// store's two index_copy_, the norms, the projections, rope, attention), each a few microseconds of interpreter
// and dispatcher. On the bench model (8 layers) that was ~0.8 ms of a 3.7 ms batch-1 decode step, where the
// projections themselves run at the memory's pace, and ~1 ms of a 16-sequence step. Here the same kernels run
// back to back, the step's buffers are allocated once for all layers, and the KV store is a row copy.
#include "cpu_kernels.h"
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

// Write the step's K rows (k [T, nk, D], contiguous) and V rows (in qkv [T, W], from column v0) into the paged
// caches [blocks, block_size, nk, D] at their slots (block * block_size + offset); a slot below 0 is skipped.
void store_kv(const torch::Tensor& k, const torch::Tensor& qkv, int64_t v0, torch::Tensor& k_cache,
              torch::Tensor& v_cache, const int64_t* slots, int64_t T) {
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.dtype() == torch::kFloat
              && v_cache.dtype() == torch::kFloat && v_cache.numel() == k_cache.numel(),
              "llama_layers: contiguous fp32 caches");
  const int64_t row = k.size(1) * k.size(2), W = qkv.size(1), capacity = k_cache.numel() / row;
  const float* kp = k.data_ptr<float>();
  const float* vp = qkv.data_ptr<float>() + v0;
  float* kc = k_cache.data_ptr<float>();
  float* vc = v_cache.data_ptr<float>();
  for (int64_t t = 0; t < T; ++t) {
    const int64_t s = slots[t];
    if (s < 0) continue;
    TORCH_CHECK(s < capacity, "llama_layers: slot ", s, " past the cache's ", capacity);
    std::memcpy(kc + s * row, kp + t * row, row * sizeof(float));
    std::memcpy(vc + s * row, vp + t * W, row * sizeof(float));
  }
}

}  // namespace

// h [T, H]: the embeddings in; the residual stream, updated in place. weights: per layer, in order, ln1 [H],
// qkv tiles, o tiles, ln2 [H], gate_up tiles, down tiles (tiled_pack's layout, no biases); eps: per layer eps1,
// eps2. k_caches / v_caches: per layer. positions [T] int64, cos / sin [P, 1, D] (or [P, D]) tables, nq / nk
// heads, intermediate: the MLP's width. slot_mapping [T] int64. The first num_decode rows are one-token decodes
// (decode_block_tables, decode_lens: paged_decode's); the rest are prefill chunks (prefill_*: paged_prefill's).
// Returns the last layer's MLP output: h does not include it yet (the final norm adds it), as in the Python loop.
torch::Tensor llama_layers(torch::Tensor h, std::vector<torch::Tensor> weights, std::vector<double> eps,
                           std::vector<torch::Tensor> k_caches, std::vector<torch::Tensor> v_caches,
                           torch::Tensor positions, torch::Tensor cos, torch::Tensor sin, int64_t nq, int64_t nk,
                           int64_t intermediate, double scale, torch::Tensor slot_mapping, int64_t num_decode,
                           c10::optional<torch::Tensor> decode_block_tables, c10::optional<torch::Tensor> decode_lens,
                           c10::optional<torch::Tensor> prefill_block_tables,
                           c10::optional<torch::Tensor> prefill_row_starts,
                           c10::optional<torch::Tensor> prefill_first_pos) {
  const int64_t L = static_cast<int64_t>(k_caches.size());
  TORCH_CHECK(L > 0 && static_cast<int64_t>(weights.size()) == 6 * L && static_cast<int64_t>(eps.size()) == 2 * L
              && static_cast<int64_t>(v_caches.size()) == L, "llama_layers: 6 weights, 2 eps and 2 caches a layer");
  TORCH_CHECK(h.dim() == 2 && h.is_contiguous() && h.dtype() == torch::kFloat, "llama_layers: fp32 h [T, H]");
  TORCH_CHECK(slot_mapping.dtype() == torch::kLong && slot_mapping.is_contiguous()
              && slot_mapping.numel() == h.size(0), "llama_layers: int64 slot_mapping [T]");
  const int64_t T = h.size(0), H = h.size(1), D = cos.size(-1), W = (nq + 2 * nk) * D, I = intermediate;
  const int64_t nd = num_decode, np = T - num_decode;
  TORCH_CHECK(nd >= 0 && nd <= T, "llama_layers: num_decode out of range");
  TORCH_CHECK(nd == 0 || (decode_block_tables && decode_lens), "llama_layers: decodes without their tables");
  TORCH_CHECK(np == 0 || (prefill_block_tables && prefill_row_starts && prefill_first_pos),
              "llama_layers: prefill rows without their tables");
  const auto opts = h.options();
  torch::Tensor x = torch::empty({T, H}, opts), qkv = torch::empty({T, W}, opts);
  torch::Tensor q = torch::empty({T, nq, D}, opts), k = torch::empty({T, nk, D}, opts);
  torch::Tensor attn = torch::empty({T, nq, D}, opts), o_out = torch::empty({T, H}, opts);
  torch::Tensor gu = torch::empty({T, 2 * I}, opts), act = torch::empty({T, I}, opts);
  torch::Tensor delta = torch::empty({T, H}, opts);
  const torch::Tensor attn_rows = attn.view({T, nq * D});
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t i = 0; i < L; ++i) {
    const torch::Tensor* w = weights.data() + 6 * i;
    add_rms_norm(h, i ? c10::optional<torch::Tensor>(delta) : c10::nullopt, w[0], eps[2 * i], x);
    tiled_linear(x, w[1], qkv);
    rope(qkv, positions, cos, sin, nq, nk, q, k);
    store_kv(k, qkv, (nq + nk) * D, k_caches[i], v_caches[i], slots, T);
    if (nd) {
      paged_decode(q.narrow(0, 0, nd), k_caches[i], v_caches[i], *decode_block_tables, *decode_lens, scale,
                   attn.narrow(0, 0, nd));
    }
    if (np) {
      paged_prefill(q.narrow(0, nd, np), k_caches[i], v_caches[i], *prefill_block_tables, *prefill_row_starts,
                    *prefill_first_pos, scale, attn.narrow(0, nd, np));
    }
    tiled_linear(attn_rows, w[2], o_out);
    add_rms_norm(h, o_out, w[3], eps[2 * i + 1], x);
    tiled_linear(x, w[4], gu);
    silu_mul(gu, act);
    tiled_linear(act, w[5], delta);
  }
  return delta;
}
