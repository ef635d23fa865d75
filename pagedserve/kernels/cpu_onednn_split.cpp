// oneDNN's linear layers split by output features over the decode pool's threads (cpu_pool.h).
//
// Why: served on 2 cores, the engine's steps run on one torch thread (the other core is the HTTP
// stack's too, and an OpenMP region's closing barrier waits for a thread that core has not
// scheduled), so a decode step's oneDNN linears streamed their weights from one core: SmolLM2's 30
// layers at 16 rows took 19-21 ms (bf16 on AMX, 2-vCPU Xeon VM). Here each weight is prepacked as
// parts of consecutive output features, one per pool thread; each thread multiplies its part
// through oneDNN on one OpenMP thread and copies its columns into the output. A helper that has
// not got its core takes nothing (the caller runs every part), so the split never waits for one.
// Measured there, one helper: 30 layers at 16 rows 19.3 -> 10.8 ms; 256 rows 33 ms against 32
// for the whole weight on two OpenMP threads; the parts run one after the other (no helper) cost
// 10-40% more than the whole weight, so the split is made only where the pool has helpers, and
// only for steps on one torch thread (layers.linear). Opt-in (PAGEDSERVE_CPU_PREFILL_POOL=1,
// worker.py's PREFILL_POOL, which also puts prefill chunks on the pool): served on those 2 vCPUs
// the helper's core had no time to spare, and neither c16 nor c1 gained beyond the VM's drift.
//
// Results do not depend on which thread runs a part. Against the whole weight they may differ in
// the last bit where oneDNN picks another kernel for a narrower weight (its sums over K then run in
// another order): one bf16 rounding in a rare element at 300 rows in quarters of 1000 features.
#include <torch/extension.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/InferenceMode.h>
#include <omp.h>

#include "cpu_pool.h"

#include <cstring>
#include <exception>
#include <mutex>
#include <string>
#include <vector>

namespace {

using LinearPointwise = at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                                   c10::string_view, c10::List<std::optional<at::Scalar>>,
                                   std::optional<c10::string_view>);

const c10::TypedOperatorHandle<LinearPointwise>& linear_pointwise() {
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "").typed<LinearPointwise>();
  return op;
}

// OpenMP's thread count of the calling thread set to 1 while alive (oneDNN reads it per call)
struct OneOmpThread {
  int before = omp_get_max_threads();
  OneOmpThread() {
    if (before != 1) omp_set_num_threads(1);
  }
  ~OneOmpThread() {
    if (before != 1) omp_set_num_threads(before);
  }
};

}  // namespace

// x W^T + b with W prepacked for oneDNN in parts of output features [starts[i], starts[i + 1]);
// x [..., K] of the parts' dtype. Part i's product runs on whichever pool thread claims it.
at::Tensor linear_onednn_split(const at::Tensor& x, const std::vector<at::Tensor>& parts,
                               const std::vector<int64_t>& starts, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(!parts.empty() && starts.size() == parts.size() + 1, "linear_onednn_split: one start per part + end");
  const int64_t K = x.size(-1), N = starts.back();
  for (size_t i = 0; i < parts.size(); ++i)
    TORCH_CHECK(parts[i].dim() == 2 && parts[i].size(0) == starts[i + 1] - starts[i] && parts[i].size(1) == K &&
                    parts[i].scalar_type() == x.scalar_type(),
                "linear_onednn_split: part ", i, " is not [", starts[i + 1] - starts[i], ", ", K, "] of x's dtype");
  TORCH_CHECK(!bias || (bias->dim() == 1 && bias->size(0) == N), "linear_onednn_split: bias is not [", N, "]");
  const at::Tensor x2 = x.reshape({-1, K}).contiguous();
  const int64_t M = x2.size(0), es = x2.element_size();
  at::Tensor y = at::empty({M, N}, x2.options());
  char* out = static_cast<char*>(y.data_ptr());
  std::vector<std::optional<at::Tensor>> biases(parts.size());
  if (bias)
    for (size_t i = 0; i < parts.size(); ++i) biases[i] = bias->narrow(0, starts[i], starts[i + 1] - starts[i]);
  std::mutex failed_mutex;
  std::string failed;
  const auto& op = linear_pointwise();
  pagedserve_pool::Pool::get().run(static_cast<int64_t>(parts.size()), [&](int64_t i, int) {
    try {
      c10::InferenceMode inference;  // a helper thread's own mode: no autograd bookkeeping
      OneOmpThread one;
      const at::Tensor part = op.call(x2, parts[i], biases[i], "none", c10::List<std::optional<at::Scalar>>(),
                                      std::nullopt);
      const int64_t n0 = starts[i], width = starts[i + 1] - n0;
      const char* src = static_cast<const char*>(part.data_ptr());
      for (int64_t r = 0; r < M; ++r) std::memcpy(out + (r * N + n0) * es, src + r * width * es, width * es);
    } catch (const std::exception& e) {  // never out of a helper thread: rethrown on the caller's
      std::lock_guard<std::mutex> lock(failed_mutex);
      if (failed.empty()) failed = e.what();
    }
  });
  TORCH_CHECK(failed.empty(), "linear_onednn_split: ", failed);
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = N;
  return y.view(shape);
}
