// A step's decoder layers of a Llama-family model in one call: bf16, every linear layer's weight in
// cpu_blocks_bf16.cpp's GGUF block records or cpu_gemm.cpp's dense bf16 panels (AVX512-BF16 without
// AMX; a bf16 tensor where records are uint8), for steps of up to a weight's max_rows rows, or
// prepacked for oneDNN (more rows; in parts over the decode pool's threads where a step runs on
// one torch thread), attention through cpu_decode.cpp (one-token rows) and cpu_prefill.cpp
// (prefill chunks).
//
// Why: the layers' work is ~12 calls a layer into this extension or torch (norms, four linears,
// rotary, the KV write, attention, SiLU-and-mul), each reached through Python's nn.Module calls,
// the kernels package's dispatch and pybind. At decode batch sizes that was ~35% of a served-size
// decode step (16 sequences, SmolLM2, one torch thread and the decode pool's helper, py-spy,
// 2026-12-07); in a 256-token prefill on two threads ~19 of ~110 ms ran outside the kernels, and
// each gap between two parallel regions long enough for the OpenMP thread to fall asleep cost a
// wake-up on the next. Here the same functions run in the same order on the same tensors (results
// equal the modules' bit for bit), called from C++.
#include "cpu_kernels.h"

#include <ATen/core/dispatch/Dispatcher.h>

namespace {

// torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""): what layers.linear runs on
// a weight prepacked for oneDNN
at::Tensor onednn_linear(const at::Tensor& x, const at::Tensor& packed) {
  static const c10::OperatorHandle op =
      c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  torch::jit::Stack stack;
  stack.reserve(6);
  stack.emplace_back(x);
  stack.emplace_back(packed);
  stack.emplace_back(c10::IValue());
  stack.emplace_back(std::string("none"));
  stack.emplace_back(c10::List<c10::optional<at::Scalar>>());
  stack.emplace_back(std::string(""));
  op.callBoxed(&stack);
  return stack[0].toTensor();
}

}  // namespace

std::vector<at::Tensor> llama_layers(
    at::Tensor hidden, const at::Tensor& positions, const at::Tensor& slot_mapping, const at::Tensor& decode_rows,
    const at::Tensor& decode_tables, const at::Tensor& decode_lens, const std::vector<int64_t>& extend_starts,
    const std::vector<int64_t>& extend_lens, const std::vector<int64_t>& extend_seq_lens, const std::vector<at::Tensor>& extend_tables,
    const at::Tensor& cos_sin_cache, const std::vector<at::Tensor>& norms, const std::vector<at::Tensor>& records,
    const std::vector<at::Tensor>& packed, const std::vector<std::vector<at::Tensor>>& parts,
    const std::vector<std::vector<int64_t>>& part_starts, const std::vector<int64_t>& features, const std::vector<bool>& q8,
    const std::vector<bool>& amx, const std::vector<int64_t>& max_rows, std::vector<at::Tensor> k_caches,
    std::vector<at::Tensor> v_caches, const std::vector<int64_t>& windows, int64_t num_heads, int64_t num_kv_heads,
    int64_t head_dim, double eps, double scale, bool share_blocks, int64_t threads, bool prefill_amx) {
  const int64_t layers = static_cast<int64_t>(k_caches.size());
  const size_t weights = 4 * static_cast<size_t>(layers);
  TORCH_CHECK(layers > 0 && static_cast<int64_t>(v_caches.size()) == layers &&
                  static_cast<int64_t>(norms.size()) == 2 * layers && records.size() == weights &&
                  packed.size() == weights && parts.size() == weights &&
                  part_starts.size() == weights && features.size() == weights && q8.size() == weights &&
                  amx.size() == weights && max_rows.size() == weights &&
                  static_cast<int64_t>(windows.size()) == layers,
              "llama_layers: per-layer arguments do not match the number of layers");
  TORCH_CHECK(hidden.dim() == 2 && hidden.scalar_type() == at::kBFloat16, "llama_layers: bf16 hidden [T, H]");
  const int64_t T = hidden.size(0), q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
  const size_t extends = extend_starts.size();
  TORCH_CHECK(extend_lens.size() == extends && extend_seq_lens.size() == extends && extend_tables.size() == extends,
              "llama_layers: per-chunk arguments do not match");
  // rows of one-token sequences: all of them (no chunk), else decode_rows (int64, maybe empty)
  const bool all_decode = extends == 0;
  TORCH_CHECK(positions.numel() == T && slot_mapping.numel() == T, "llama_layers: one position and slot a row");
  TORCH_CHECK(!all_decode || (decode_tables.size(0) == T && decode_lens.numel() == T),
              "llama_layers: a decode step has one table and length a row");
  TORCH_CHECK(features[0] == q_size + 2 * kv_size, "llama_layers: the QKV layer's features are not the heads'");
  for (size_t w = 0; w < weights; ++w)
    TORCH_CHECK((records[w].numel() > 0 && T <= max_rows[w]) || packed[w].numel() > 0 || !parts[w].empty(),
                "llama_layers: weight ", w, " has no kernel for ", T, " rows");
  const bool has_decode = all_decode || decode_rows.numel() > 0;
  at::Tensor residual;
  for (int64_t i = 0; i < layers; ++i) {
    if (i == 0) {
      residual = hidden;
      hidden = rms_norm(hidden, norms[0], eps);
    } else {
      fused_add_rms_norm(hidden, residual, norms[2 * i], eps);
    }
    auto lin = [&](const at::Tensor& x, int64_t j) {
      const size_t w = static_cast<size_t>(4 * i + j);
      if (records[w].numel() > 0 && x.size(0) <= max_rows[w])  // bf16: cpu_gemm.cpp's dense panels
        return records[w].scalar_type() == at::kBFloat16
                   ? linear_packed(x, records[w], c10::nullopt, features[w])
                   : linear_blocks_bf16(x, records[w], c10::nullopt, features[w], q8[w], amx[w]);
      if (!parts[w].empty() && at::get_num_threads() == 1)  // layers.linear's OnednnParts
        return linear_onednn_split(x, parts[w], part_starts[w], c10::nullopt);
      return onednn_linear(x, packed[w]);
    };
    at::Tensor qkv = lin(hidden, 0);
    at::Tensor q = qkv.narrow(1, 0, q_size), k = qkv.narrow(1, q_size, kv_size);
    const at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size);
    rotary_neox(positions, q, k, cos_sin_cache, head_dim);
    write_kv(k, v, k_caches[i], v_caches[i], slot_mapping);
    const at::Tensor query = q.view({T, num_heads, head_dim});
    at::Tensor attn;
    if (all_decode) {
      attn = paged_decode(query, k_caches[i], v_caches[i], decode_tables, decode_lens, scale, windows[i],
                          share_blocks, threads);
    } else if (!has_decode && extends == 1) {  // one sequence's chunk: its kernel's output is the step's
      attn = paged_prefill(query, k_caches[i], v_caches[i], extend_tables[0], extend_seq_lens[0], scale, windows[i],
                           prefill_amx);
    } else {  // kernels/cpu.py's paged_attention
      attn = at::empty_like(query, query.options().memory_format(at::MemoryFormat::Contiguous));
      if (has_decode)
        attn.index_copy_(0, decode_rows,
                         paged_decode(query.index_select(0, decode_rows), k_caches[i], v_caches[i], decode_tables,
                                      decode_lens, scale, windows[i], share_blocks, threads));
      for (size_t e = 0; e < extends; ++e) {
        const int64_t start = extend_starts[e], len = extend_lens[e];
        attn.narrow(0, start, len)
            .copy_(paged_prefill(query.narrow(0, start, len), k_caches[i], v_caches[i], extend_tables[e],
                                 extend_seq_lens[e], scale, windows[i], prefill_amx));
      }
    }
    at::Tensor o = lin(attn.view({T, q_size}), 1);
    fused_add_rms_norm(o, residual, norms[2 * i + 1], eps);
    hidden = lin(silu_and_mul(lin(o, 2)), 3);
  }
  return {hidden, residual};
}
