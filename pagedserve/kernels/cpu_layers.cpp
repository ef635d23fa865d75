// A decode step's decoder layers of a Llama-family model in one call: bf16, every linear layer's
// weight in cpu_blocks_bf16.cpp's GGUF block records, one query token per sequence.
//
// Why: the layers' work at decode batch sizes is ~12 calls a layer into this extension (norms,
// four linears, rotary, the KV write, attention, SiLU-and-mul), each reached through Python's
// nn.Module calls, the kernels package's dispatch and pybind: ~35% of a served-size decode step
// (16 sequences, SmolLM2, one torch thread and the decode pool's helper, py-spy, 2026-12-07) ran
// in the interpreter and the binding between them. Here the same functions run in the same order
// on the same tensors (results equal the modules' bit for bit), called from C++.
#include "cpu_kernels.h"

std::vector<at::Tensor> llama_decode_layers(
    at::Tensor hidden, const at::Tensor& positions, const at::Tensor& slot_mapping, const at::Tensor& block_tables,
    const at::Tensor& seq_lens, const at::Tensor& cos_sin_cache, const std::vector<at::Tensor>& norms,
    const std::vector<at::Tensor>& records, const std::vector<int64_t>& features, const std::vector<bool>& q8,
    const std::vector<bool>& amx, std::vector<at::Tensor> k_caches, std::vector<at::Tensor> v_caches,
    const std::vector<int64_t>& windows, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double eps,
    double scale, bool share_blocks, int64_t threads) {
  const int64_t layers = static_cast<int64_t>(k_caches.size());
  TORCH_CHECK(layers > 0 && static_cast<int64_t>(v_caches.size()) == layers &&
                  static_cast<int64_t>(norms.size()) == 2 * layers &&
                  static_cast<int64_t>(records.size()) == 4 * layers &&
                  static_cast<int64_t>(features.size()) == 4 * layers && static_cast<int64_t>(q8.size()) == 4 * layers &&
                  static_cast<int64_t>(amx.size()) == 4 * layers && static_cast<int64_t>(windows.size()) == layers,
              "llama_decode_layers: per-layer arguments do not match the number of layers");
  TORCH_CHECK(hidden.dim() == 2 && hidden.scalar_type() == at::kBFloat16, "llama_decode_layers: bf16 hidden [B, H]");
  const int64_t B = hidden.size(0), q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
  TORCH_CHECK(positions.numel() == B && slot_mapping.numel() == B && block_tables.size(0) == B &&
                  seq_lens.numel() == B, "llama_decode_layers: one token per sequence");
  TORCH_CHECK(features[0] == q_size + 2 * kv_size, "llama_decode_layers: the QKV layer's features are not the heads'");
  at::Tensor residual;
  for (int64_t i = 0; i < layers; ++i) {
    if (i == 0) {
      residual = hidden;
      hidden = rms_norm(hidden, norms[0], eps);
    } else {
      fused_add_rms_norm(hidden, residual, norms[2 * i], eps);
    }
    auto lin = [&](const at::Tensor& x, int64_t j) {
      const int64_t w = 4 * i + j;
      return linear_blocks_bf16(x, records[w], c10::nullopt, features[w], q8[w], amx[w]);
    };
    at::Tensor qkv = lin(hidden, 0);
    at::Tensor q = qkv.narrow(1, 0, q_size), k = qkv.narrow(1, q_size, kv_size);
    const at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size);
    rotary_neox(positions, q, k, cos_sin_cache, head_dim);
    write_kv(k, v, k_caches[i], v_caches[i], slot_mapping);
    at::Tensor attn = paged_decode(q.view({B, num_heads, head_dim}), k_caches[i], v_caches[i], block_tables, seq_lens,
                                   scale, windows[i], share_blocks, threads);
    at::Tensor o = lin(attn.view({B, q_size}), 1);
    fused_add_rms_norm(o, residual, norms[2 * i + 1], eps);
    hidden = lin(silu_and_mul(lin(o, 2)), 3);
  }
  return {hidden, residual};
}
