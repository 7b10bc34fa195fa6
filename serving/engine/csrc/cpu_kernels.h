// CPU kernels of the engine's fp32 path (built by serving/engine/cpu_kernels.py, whose docstring describes
// them): paged_decode (paged_decode.cpp), paged_prefill (paged_prefill.cpp), and add_rms_norm, silu_mul and
// rope (elementwise.cpp), tiled_pack / tiled_linear (tiled_gemm.cpp), lora_add (lora.cpp), and llama_layers
// (llama_layers.cpp: every decoder layer through the others in one call); cpu_kernels.cpp binds them to Python.
// Shapes are in the comments at each definition.
#pragma once
#include <torch/types.h>
#include <vector>

void paged_decode(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor block_tables,
                  torch::Tensor context_lens, double scale, torch::Tensor out);
void paged_prefill(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor block_tables,
                   torch::Tensor row_starts, torch::Tensor first_pos, double scale, torch::Tensor out);
void add_rms_norm(torch::Tensor h, c10::optional<torch::Tensor> delta, torch::Tensor weight, double eps,
                  torch::Tensor out);
void silu_mul(torch::Tensor gu, torch::Tensor out);
void rope(torch::Tensor qkv, torch::Tensor positions, torch::Tensor cos, torch::Tensor sin, int64_t nq,
          int64_t nk, torch::Tensor q_out, torch::Tensor k_out);
bool tiled_gemm_available();
torch::Tensor tiled_pack(torch::Tensor w);
void tiled_linear(torch::Tensor x, torch::Tensor tiles, torch::Tensor out);
void lora_add(torch::Tensor out, torch::Tensor x, torch::Tensor A, torch::Tensor B, torch::Tensor row_slots,
              torch::Tensor parts, int64_t rank);
torch::Tensor llama_layers(torch::Tensor h, std::vector<torch::Tensor> weights, std::vector<double> eps,
                           std::vector<torch::Tensor> k_caches, std::vector<torch::Tensor> v_caches,
                           torch::Tensor positions, torch::Tensor cos, torch::Tensor sin, int64_t nq, int64_t nk,
                           int64_t intermediate, double scale, torch::Tensor slot_mapping, int64_t num_decode,
                           c10::optional<torch::Tensor> decode_block_tables, c10::optional<torch::Tensor> decode_lens,
                           c10::optional<torch::Tensor> prefill_block_tables,
                           c10::optional<torch::Tensor> prefill_row_starts,
                           c10::optional<torch::Tensor> prefill_first_pos);
