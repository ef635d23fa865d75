// The extension's entry points, declared once: defined in their own .cpp files, bound to Python in
// cpu_decode.cpp, and called across files (cpu_layers.cpp runs a step's layers through them,
// cpu_prefill.cpp asks cpu_blocks_bf16.cpp whether the AMX tiles were granted).
#pragma once
#include <torch/extension.h>

#include <vector>

// cpu_decode.cpp
at::Tensor paged_decode(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                        const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale,
                        int64_t window, bool share_blocks, int64_t threads);
// cpu_ops.cpp
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
void fused_add_rms_norm(at::Tensor& x, at::Tensor& residual, const at::Tensor& weight, double eps);
void rotary_neox(const at::Tensor& positions, at::Tensor& query, at::Tensor& key, const at::Tensor& cos_sin_cache,
                 int64_t head_dim);
at::Tensor silu_and_mul(const at::Tensor& x);
at::Tensor argmax_rows(const at::Tensor& x);
at::Tensor sample_rows(const at::Tensor& x, const at::Tensor& temperature, const at::Tensor& uniforms);
void write_kv(const at::Tensor& key, const at::Tensor& value, at::Tensor& k_cache, at::Tensor& v_cache,
              const at::Tensor& slot_mapping);
// cpu_gemm.cpp
bool gemm_available();
bool gemm_bf16_available();
at::Tensor pack_linear(const at::Tensor& weight);
at::Tensor linear_packed(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                         int64_t N);
at::Tensor linear_blocks(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scales,
                         const c10::optional<at::Tensor>& bias, int64_t N, bool q8);
void set_decode_pool(int64_t helpers, int64_t spin_us);
int64_t decode_pool_helpers();
// cpu_blocks_bf16.cpp
bool blocks_bf16_available();
bool blocks_amx_available();
at::Tensor linear_blocks_bf16(const at::Tensor& x, const at::Tensor& records, const c10::optional<at::Tensor>& bias,
                              int64_t N, bool q8, bool use_amx);
// cpu_onednn_split.cpp
at::Tensor linear_onednn_split(const at::Tensor& x, const std::vector<at::Tensor>& parts,
                               const std::vector<int64_t>& starts, const c10::optional<at::Tensor>& bias);
// cpu_prefill.cpp
bool prefill_bf16_available();
bool prefill_amx_available();
at::Tensor paged_prefill(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                         const at::Tensor& table, int64_t seq_len, double scale, int64_t window, bool use_amx);
// cpu_layers.cpp
// hidden [T, H]: the step's embeddings. Per layer i: norms[2 i] (input) and [2 i + 1]
// (post-attention) RMSNorm weights; for its linears j = qkv, o, gate_up, down, [4 i + j]: the
// weight's GGUF block records (linear_blocks_bf16's records, features, q8 and amx; or, bf16, its
// dense panels of pack_linear for linear_packed; an empty tensor where it has none), taken for steps
// of up to max_rows rows, else its oneDNN-prepacked weight
// (empty where it has none), or where parts[4 i + j] is not empty and the step runs on one torch
// thread, those (linear_onednn_split's parts and starts); its K and V pools and sliding window (0: none). positions and
// slot_mapping int64 [T]. Attention: without chunks every row is one sequence's one token
// (decode_tables and decode_lens, int32, paged_decode's); else decode_rows (int64, maybe empty)
// are such rows, and chunk e is rows extend_starts[e] .. + extend_lens[e] of a sequence of
// extend_seq_lens[e] tokens with the int32 block table extend_tables[e] (paged_prefill's).
// Returns (hidden, residual) of the last layer: the final norm's input pair, as LlamaModel's loop
// leaves them.
std::vector<at::Tensor> llama_layers(
    at::Tensor hidden, const at::Tensor& positions, const at::Tensor& slot_mapping, const at::Tensor& decode_rows,
    const at::Tensor& decode_tables, const at::Tensor& decode_lens, const std::vector<int64_t>& extend_starts,
    const std::vector<int64_t>& extend_lens, const std::vector<int64_t>& extend_seq_lens,
    const std::vector<at::Tensor>& extend_tables, const at::Tensor& cos_sin_cache, const std::vector<at::Tensor>& norms,
    const std::vector<at::Tensor>& records, const std::vector<at::Tensor>& packed,
    const std::vector<std::vector<at::Tensor>>& parts, const std::vector<std::vector<int64_t>>& part_starts,
    const std::vector<int64_t>& features,
    const std::vector<bool>& q8, const std::vector<bool>& amx, const std::vector<int64_t>& max_rows,
    std::vector<at::Tensor> k_caches, std::vector<at::Tensor> v_caches, const std::vector<int64_t>& windows,
    int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double eps, double scale, bool share_blocks,
    int64_t threads, bool prefill_amx);
