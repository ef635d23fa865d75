// cpu_layers.cpp's entry point, declared once for it and for cpu_decode.cpp's bindings.
#pragma once
#include <torch/extension.h>

#include <vector>

// hidden [B, H]: the step's embeddings (one token per sequence). Per layer i: norms[2 i] (input)
// and [2 i + 1] (post-attention) RMSNorm weights; records, features, q8 and amx [4 i + j] for its
// linears j = qkv, o, gate_up, down (linear_blocks_bf16's arguments); its K and V pools and
// sliding window (0: none). positions and slot_mapping int64 [B]; block_tables and seq_lens int32
// (paged_decode's). Returns (hidden, residual) of the last layer: the final norm's input pair, as
// LlamaModel's loop leaves them.
std::vector<at::Tensor> llama_decode_layers(
    at::Tensor hidden, const at::Tensor& positions, const at::Tensor& slot_mapping, const at::Tensor& block_tables,
    const at::Tensor& seq_lens, const at::Tensor& cos_sin_cache, const std::vector<at::Tensor>& norms,
    const std::vector<at::Tensor>& records, const std::vector<int64_t>& features, const std::vector<bool>& q8,
    const std::vector<bool>& amx, std::vector<at::Tensor> k_caches, std::vector<at::Tensor> v_caches,
    const std::vector<int64_t>& windows, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double eps,
    double scale, bool share_blocks, int64_t threads);
