// Fused elementwise ops of a Llama decoder layer on CPU: RMSNorm (with the residual add), NeoX
// rotary embedding in place, SiLU-and-mul, and the KV write. Each replaces 3 to 25 eager torch
// ops (and their dispatch, allocations and dtype casts) with one pass over the rows.
//
// The torch reference (layers.py, reference.py) is the oracle, and the rounding follows it: in
// bf16 and fp16 every intermediate the reference keeps in the model dtype is rounded here too
// (the normalized row before the weight multiplies it, cos/sin cast to the model dtype, each
// product of the rotation, the SiLU before the multiply). In bf16 the norms and the rotation
// match the reference bit for bit; ~0.05% of SiLU outputs differ by one ulp (a polynomial exp);
// in fp32 results differ by float rounding (sums taken in another order).
//
// fp32 and bf16 rows run in AVX-512 vectors of 16 (cpu_vec.h), the roundings included (torch's
// round-to-nearest-even in integer ops). The scalar loops before, with a branch per bf16 rounding,
// did not vectorize: for a 2048-token prefill chunk (30 layers, one thread) the norms took 158 ms,
// the rotation 69 and SiLU-and-mul 161 of a 1188 ms step; vectorized 53, 33 and 110 ms.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <algorithm>
#include <vector>
#include <type_traits>

#include "cpu_pool.h"
#include "cpu_vec.h"

namespace {

#if defined(__AVX512F__)
template <typename T>
constexpr bool kVec = std::is_same_v<T, float> || std::is_same_v<T, at::BFloat16>;
#else
template <typename T>
constexpr bool kVec = false;
#endif

inline float to_f(float v) { return v; }
inline float to_f(at::BFloat16 v) {
  uint32_t bits = static_cast<uint32_t>(v.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}
inline float to_f(at::Half v) { return static_cast<float>(v); }

// float -> T with round-to-nearest-even (the same as torch's casts)
template <typename T>
inline T from_f(float f) {
  if constexpr (std::is_same_v<T, float>) {
    return f;
  } else if constexpr (std::is_same_v<T, at::BFloat16>) {
    uint32_t u;
    std::memcpy(&u, &f, sizeof(u));
    at::BFloat16 out;
    if ((u & 0x7fffffffu) > 0x7f800000u) {
      out.x = 0x7fc0;
    } else {
      u += 0x7fffu + ((u >> 16) & 1u);
      out.x = static_cast<uint16_t>(u >> 16);
    }
    return out;
  } else {
    return static_cast<T>(f);
  }
}

// The value the reference holds after rounding an fp32 result to the model dtype.
template <typename T>
inline float round_to(float f) {
  if constexpr (std::is_same_v<T, float>) return f;
  return to_f(from_f<T>(f));
}

constexpr int64_t kRowGrain = 16;  // rows per task: decode steps (few rows) stay on one thread

// out[i] = w * round(x[i] * rsqrt(mean(x[i]^2) + eps)), x read from row i of `x` (fp32 math).
template <typename T>
void rms_rows(const T* x, int64_t xs, const T* w, T* out, int64_t os, int64_t T_, int64_t H, float eps,
              T* res, int64_t rs) {
  pagedserve_pool::rows_for(T_, kRowGrain, [&](int64_t begin, int64_t end) {
    std::vector<float> row(H);
    for (int64_t t = begin; t < end; ++t) {
      const T* xr = x + t * xs;
      T* rr = res != nullptr ? res + t * rs : nullptr;
      T* orow = out + t * os;
      int64_t h0 = 0;  // features [0, h0) done with vectors, the tail in scalar code
      float ss = 0.0f;
#if defined(__AVX512F__)
      if constexpr (kVec<T>) {
        __m512 vss = _mm512_setzero_ps();
        for (; h0 + 16 <= H; h0 += 16) {
          __m512 v = load16(xr + h0);
          if (rr != nullptr) {
            v = round16(T{}, _mm512_add_ps(v, load16(rr + h0)));
            store16(rr + h0, v);
          }
          _mm512_storeu_ps(row.data() + h0, v);
          vss = _mm512_fmadd_ps(v, v, vss);
        }
        ss = _mm512_reduce_add_ps(vss);
      }
#endif
      for (int64_t h = h0; h < H; ++h) {
        if (rr != nullptr) {
          // fused residual add: res <- round(x + res), then normalize res
          const T sum = from_f<T>(to_f(xr[h]) + to_f(rr[h]));
          rr[h] = sum;
          row[h] = to_f(sum);
        } else {
          row[h] = to_f(xr[h]);
        }
        ss += row[h] * row[h];
      }
      const float r = 1.0f / std::sqrt(ss / static_cast<float>(H) + eps);
#if defined(__AVX512F__)
      if constexpr (kVec<T>) {
        const __m512 vr = _mm512_set1_ps(r);
        for (int64_t h = 0; h < h0; h += 16) {
          const __m512 normed = round16(T{}, _mm512_mul_ps(_mm512_loadu_ps(row.data() + h), vr));
          store16(orow + h, _mm512_mul_ps(load16(w + h), normed));
        }
      }
#endif
      for (int64_t h = h0; h < H; ++h) orow[h] = from_f<T>(to_f(w[h]) * round_to<T>(row[h] * r));
    }
  });
}

template <typename F>
void dispatch(at::ScalarType dtype, const char* name, F&& f) {
  switch (dtype) {
    case at::kFloat:
      f(float{});
      break;
    case at::kBFloat16:
      f(at::BFloat16{});
      break;
    case at::kHalf:
      f(at::Half{});
      break;
    default:
      TORCH_CHECK(false, name, ": unsupported dtype ", dtype);
  }
}

void check_rows(const at::Tensor& x, const char* what) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, what, " must be 2-D [rows, features] with contiguous rows");
}

}  // namespace

// Llama's RMSNorm: weight * round(x * rsqrt(mean(x^2) + eps)) per row (a new tensor).
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows(x, "x");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == x.size(1) && weight.scalar_type() == x.scalar_type(),
              "weight must be contiguous [features] in x's dtype");
  at::Tensor out = at::empty_like(x, x.options().memory_format(at::MemoryFormat::Contiguous));
  dispatch(x.scalar_type(), "rms_norm", [&](auto tag) {
    using T = decltype(tag);
    rms_rows<T>(x.data_ptr<T>(), x.stride(0), weight.data_ptr<T>(), out.data_ptr<T>(), out.stride(0),
                x.size(0), x.size(1), static_cast<float>(eps), nullptr, 0);
  });
  return out;
}

// In place: residual <- round(x + residual); x <- RMSNorm(residual) (vLLM's fused_add_rms_norm).
void fused_add_rms_norm(at::Tensor& x, at::Tensor& residual, const at::Tensor& weight, double eps) {
  check_rows(x, "x");
  check_rows(residual, "residual");
  TORCH_CHECK(x.sizes() == residual.sizes() && x.scalar_type() == residual.scalar_type(),
              "x and residual must match");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == x.size(1) && weight.scalar_type() == x.scalar_type(),
              "weight must be contiguous [features] in x's dtype");
  dispatch(x.scalar_type(), "fused_add_rms_norm", [&](auto tag) {
    using T = decltype(tag);
    rms_rows<T>(x.data_ptr<T>(), x.stride(0), weight.data_ptr<T>(), x.data_ptr<T>(), x.stride(0), x.size(0),
                x.size(1), static_cast<float>(eps), residual.data_ptr<T>(), residual.stride(0));
  });
}

// In place, NeoX layout: the two halves of each head rotate together by the angle of the token's
// position; cos_sin_cache fp32 [max_position, head_dim] holds [cos | sin] of every position.
void rotary_neox(const at::Tensor& positions, at::Tensor& query, at::Tensor& key, const at::Tensor& cos_sin_cache,
                 int64_t head_dim) {
  check_rows(query, "query");
  check_rows(key, "key");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous() &&
                  positions.numel() == query.size(0) && key.size(0) == query.size(0),
              "positions must be contiguous int64 [tokens]");
  TORCH_CHECK(cos_sin_cache.scalar_type() == at::kFloat && cos_sin_cache.is_contiguous() &&
                  cos_sin_cache.size(1) == head_dim && head_dim % 2 == 0,
              "cos_sin_cache must be contiguous fp32 [positions, head_dim]");
  TORCH_CHECK(query.size(1) % head_dim == 0 && key.size(1) % head_dim == 0, "heads of head_dim");
  TORCH_CHECK(query.scalar_type() == key.scalar_type(), "query and key must share a dtype");
  const int64_t T_ = query.size(0), half = head_dim / 2, max_pos = cos_sin_cache.size(0);
  const int64_t* pos = positions.data_ptr<int64_t>();
  const float* cache = cos_sin_cache.data_ptr<float>();
  for (int64_t t = 0; t < T_; ++t)
    TORCH_CHECK(pos[t] >= 0 && pos[t] < max_pos, "position ", pos[t], " outside the RoPE cache");
  dispatch(query.scalar_type(), "rotary_neox", [&](auto tag) {
    using T = decltype(tag);
    auto rotate = [&](T* x, int64_t stride, int64_t heads) {
      pagedserve_pool::rows_for(T_, kRowGrain, [&](int64_t begin, int64_t end) {
        std::vector<float> c(half), s(half);
        for (int64_t t = begin; t < end; ++t) {
          const float* cs = cache + pos[t] * head_dim;
          for (int64_t i = 0; i < half; ++i) {
            c[i] = round_to<T>(cs[i]);
            s[i] = round_to<T>(cs[half + i]);
          }
          for (int64_t h = 0; h < heads; ++h) {
            T* x1 = x + t * stride + h * head_dim;
            T* x2 = x1 + half;
            int64_t i0 = 0;
#if defined(__AVX512F__)
            if constexpr (kVec<T>) {
              const T tag{};
              for (; i0 + 16 <= half; i0 += 16) {
                const __m512 a = load16(x1 + i0), b = load16(x2 + i0);
                const __m512 cv = _mm512_loadu_ps(c.data() + i0), sv = _mm512_loadu_ps(s.data() + i0);
                auto rounded = [tag](__m512 x, __m512 y) { return round16(tag, _mm512_mul_ps(x, y)); };
                store16(x1 + i0, _mm512_sub_ps(rounded(a, cv), rounded(b, sv)));
                store16(x2 + i0, _mm512_add_ps(rounded(b, cv), rounded(a, sv)));
              }
            }
#endif
            for (int64_t i = i0; i < half; ++i) {
              const float a = to_f(x1[i]), b = to_f(x2[i]);
              const float r1 = round_to<T>(round_to<T>(a * c[i]) - round_to<T>(b * s[i]));
              const float r2 = round_to<T>(round_to<T>(b * c[i]) + round_to<T>(a * s[i]));
              x1[i] = from_f<T>(r1);
              x2[i] = from_f<T>(r2);
            }
          }
        }
      });
    };
    rotate(query.data_ptr<T>(), query.stride(0), query.size(1) / head_dim);
    rotate(key.data_ptr<T>(), key.stride(0), key.size(1) / head_dim);
  });
}

// silu(x[:, :d]) * x[:, d:] (a new [rows, d] tensor), the SiLU rounded to the dtype first.
at::Tensor silu_and_mul(const at::Tensor& x) {
  check_rows(x, "x");
  TORCH_CHECK(x.size(1) % 2 == 0, "x must have an even number of features");
  const int64_t T_ = x.size(0), d = x.size(1) / 2;
  at::Tensor out = at::empty({T_, d}, x.options());
  dispatch(x.scalar_type(), "silu_and_mul", [&](auto tag) {
    using T = decltype(tag);
    const T* xp = x.data_ptr<T>();
    T* op = out.data_ptr<T>();
    const int64_t xs = x.stride(0);
    pagedserve_pool::rows_for(T_, kRowGrain, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const T* g = xp + t * xs;
        const T* u = g + d;
        T* o = op + t * d;
        int64_t i0 = 0;
#if defined(__AVX512F__)
        if constexpr (kVec<T>) {
          const __m512 one = _mm512_set1_ps(1.0f);
          for (; i0 + 16 <= d; i0 += 16) {
            const __m512 gv = load16(g + i0);
            // g / (1 + exp(-g)): the reciprocal by rcp14 and one Newton step (~1e-8 relative), a
            // division costs more than the rest of the loop together
            const __m512 den = _mm512_add_ps(one, exp512(_mm512_sub_ps(_mm512_setzero_ps(), gv)));
            __m512 inv = _mm512_rcp14_ps(den);
            inv = _mm512_mul_ps(inv, _mm512_fnmadd_ps(den, inv, _mm512_set1_ps(2.0f)));
            const __m512 silu = _mm512_mul_ps(gv, inv);
            store16(o + i0, _mm512_mul_ps(round16(T{}, silu), load16(u + i0)));
          }
        }
#endif
        for (int64_t i = i0; i < d; ++i) {
          const float gf = to_f(g[i]);
          o[i] = from_f<T>(round_to<T>(gf / (1.0f + std::exp(-gf))) * to_f(u[i]));
        }
      }
    });
  });
  return out;
}

// Store each token's K and V rows ([tokens, Hkv * D], rows may be strided) at its slot of the
// contiguous pools [num_blocks, block_size, Hkv, D]; a negative slot is padding and skipped.
void write_kv(const at::Tensor& key, const at::Tensor& value, at::Tensor& k_cache, at::Tensor& v_cache,
              const at::Tensor& slot_mapping) {
  check_rows(key, "key");
  check_rows(value, "value");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.sizes() == v_cache.sizes(),
              "caches must be contiguous and alike");
  TORCH_CHECK(key.scalar_type() == k_cache.scalar_type() && value.scalar_type() == v_cache.scalar_type(),
              "K/V must be in the cache dtype");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() &&
                  slot_mapping.numel() == key.size(0) && value.size(0) == key.size(0),
              "slot_mapping must be contiguous int64 [tokens]");
  const int64_t row = k_cache.numel() / (k_cache.size(0) * k_cache.size(1));
  TORCH_CHECK(key.size(1) == row && value.size(1) == row, "K/V rows must be Hkv * head_dim wide");
  const int64_t num_slots = k_cache.size(0) * k_cache.size(1), T_ = key.size(0);
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < T_; ++t) TORCH_CHECK(slots[t] < num_slots, "slot ", slots[t], " outside the pool");
  const int64_t bytes = row * key.element_size();
  char* kc = static_cast<char*>(k_cache.data_ptr());
  char* vc = static_cast<char*>(v_cache.data_ptr());
  const char* kp = static_cast<const char*>(key.data_ptr());
  const char* vp = static_cast<const char*>(value.data_ptr());
  const int64_t ks = key.stride(0) * key.element_size(), vs = value.stride(0) * value.element_size();
  for (int64_t t = 0; t < T_; ++t) {
    if (slots[t] < 0) continue;
    std::memcpy(kc + slots[t] * bytes, kp + t * ks, bytes);
    std::memcpy(vc + slots[t] * bytes, vp + t * vs, bytes);
  }
}

// The index of each row's largest value (int64 [rows]) for fp32 rows, as torch.argmax(dim=-1)
// gives it: the first index where the largest value occurs, the first NaN where a row has one.
// torch's CPU argmax reads ~2 GB/s a core: 1.8 ms for a greedy batch of 16 over a 49152-token
// vocabulary, against 0.19 ms here (a vector of running maxima and their indices, lanes strictly
// greater replacing, so each lane keeps its first maximum; then the least index among the lanes
// that hold the row's maximum).
namespace {
// NaN tests on the bits: -ffast-math lets the compiler assume there are none
inline bool is_nan_bits(float v) {
  uint32_t u;
  std::memcpy(&u, &v, 4);
  return (u & 0x7fffffffu) > 0x7f800000u;
}
#if defined(__AVX512F__)
inline __mmask16 nan_lanes(__m512 v) {
  const __m512i bits = _mm512_and_si512(_mm512_castps_si512(v), _mm512_set1_epi32(0x7fffffff));
  return _mm512_cmpgt_epi32_mask(bits, _mm512_set1_epi32(0x7f800000));
}
#endif
}  // namespace

at::Tensor argmax_rows(const at::Tensor& x) {
  check_rows(x, "argmax_rows: x");
  TORCH_CHECK(x.scalar_type() == at::kFloat, "argmax_rows: fp32 x");
  const int64_t rows = x.size(0), V = x.size(1), xs = x.stride(0);
  TORCH_CHECK(V > 0 && V < (int64_t{1} << 31), "argmax_rows: rows of 1 to 2^31 - 1 values");
  at::Tensor out = at::empty({rows}, x.options().dtype(at::kLong));
  const float* xp = x.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = xp + r * xs;
    int64_t best = -1;
#if defined(__AVX512F__)
    __m512 vmax = _mm512_set1_ps(-INFINITY);
    __m512i vidx = _mm512_setzero_si512(), idx = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    const __m512i step = _mm512_set1_epi32(16);
    __mmask16 nan = 0;
    int64_t i = 0;
    auto take = [&](__m512 v) {  // one vector of the row, its lanes' indices in idx
      nan |= nan_lanes(v);
      const __mmask16 gt = _mm512_cmp_ps_mask(v, vmax, _CMP_GT_OQ);
      vmax = _mm512_mask_mov_ps(vmax, gt, v), vidx = _mm512_mask_mov_epi32(vidx, gt, idx);
    };
    for (; i + 16 <= V; i += 16, idx = _mm512_add_epi32(idx, step)) take(_mm512_loadu_ps(row + i));
    if (i < V) {  // the tail, its missing lanes -inf (never strictly greater)
      const __mmask16 tail = static_cast<__mmask16>((1u << (V - i)) - 1);
      take(_mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), tail, row + i));
    }
    if (!nan) {
      const float top = _mm512_reduce_max_ps(vmax);
      const __mmask16 at_top = _mm512_cmp_ps_mask(vmax, _mm512_set1_ps(top), _CMP_EQ_OQ);
      // a row of -inf only never replaces a lane: all hold index 0, the answer
      best = _mm512_mask_reduce_min_epi32(at_top, vidx);
    }
#endif
    if (best < 0) {  // a NaN (torch takes it as the largest), or no AVX-512: one pass in order
      best = 0;
      for (int64_t j = 0; j < V; ++j) {
        if (is_nan_bits(row[j])) {
          best = j;
          break;
        }
        if (row[j] > row[best]) best = j;
      }
    }
    op[r] = best;
  }
  return out;
}

// Each fp32 row's token drawn from softmax(x / temperature) at its uniform u in [0, 1): the first
// index whose running sum of exp(x / t - max) exceeds u times the row's total, as the sampler's
// torch code draws it (sampling.sample_inverse_cdf: divide, subtract the max, exp, cumsum,
// searchsorted; 6 passes over the row and a [rows, vocab] CDF). Here: one pass for the max, one
// for the exponentials (kept in a per-thread row buffer, their sums per vector of 16 in a double
// prefix), a binary search over the vectors' prefix and a walk within the one vector the target
// falls in. Entries below exp(-87.3) of the max count as 0 (torch: < 1.2e-38 of the mass), so a
// -inf entry is never drawn. `temperature`: one per row, or empty (all 1). Returns int64 [rows];
// -1 for a row whose max is not finite (NaN, or all -inf): the caller draws those with torch.
// Rows run on the decode pool's threads (rows_for).
at::Tensor sample_rows(const at::Tensor& x, const at::Tensor& temperature, const at::Tensor& uniforms) {
  check_rows(x, "sample_rows: x");
  TORCH_CHECK(x.scalar_type() == at::kFloat, "sample_rows: fp32 x");
  const int64_t rows = x.size(0), V = x.size(1), xs = x.stride(0);
  TORCH_CHECK(V > 0 && V < (int64_t{1} << 31), "sample_rows: rows of 1 to 2^31 - 1 values");
  TORCH_CHECK(uniforms.scalar_type() == at::kFloat && uniforms.is_contiguous() && uniforms.numel() == rows,
              "sample_rows: one fp32 uniform per row");
  const bool scaled = temperature.numel() > 0;
  TORCH_CHECK(!scaled || (temperature.scalar_type() == at::kFloat && temperature.is_contiguous() &&
                          temperature.numel() == rows),
              "sample_rows: one fp32 temperature per row, or none");
  at::Tensor out = at::empty({rows}, x.options().dtype(at::kLong));
  const float* xp = x.data_ptr<float>();
  const float* up = uniforms.data_ptr<float>();
  const float* tp = scaled ? temperature.data_ptr<float>() : nullptr;
  int64_t* op = out.data_ptr<int64_t>();
  const int64_t nvec = (V + 15) / 16;
  pagedserve_pool::rows_for(rows, 1, [&](int64_t begin, int64_t end) {
    thread_local std::vector<float> e;
    thread_local std::vector<double> prefix;
    if (static_cast<int64_t>(e.size()) < nvec * 16) e.assign(nvec * 16, 0.0f);
    if (static_cast<int64_t>(prefix.size()) < nvec) prefix.assign(nvec, 0.0);
    for (int64_t r = begin; r < end; ++r) {
      const float* row = xp + r * xs;
      float* ep = e.data();
      const float t = scaled ? tp[r] : 1.0f;
      // pass 1: y = x / t (into the buffer where scaled) and its max
      const float* y = row;
      if (scaled) {
        for (int64_t i = 0; i < V; ++i) ep[i] = row[i] / t;
        y = ep;
      }
      float m = y[0];
      bool nan = false;
#if defined(__AVX512F__)
      {
        __m512 vmax = _mm512_set1_ps(y[0]);
        __mmask16 nl = 0;
        for (int64_t v = 0; v < nvec; ++v) {
          const int64_t i = v * 16;
          const __mmask16 lanes = i + 16 <= V ? static_cast<__mmask16>(0xffff)
                                              : static_cast<__mmask16>((1u << (V - i)) - 1);
          const __m512 yv = _mm512_mask_loadu_ps(_mm512_set1_ps(y[0]), lanes, y + i);
          nl |= nan_lanes(yv);
          vmax = _mm512_max_ps(vmax, yv);
        }
        m = _mm512_reduce_max_ps(vmax);
        nan = nl != 0;
      }
#else
      for (int64_t i = 0; i < V; ++i) {
        nan |= is_nan_bits(y[i]);
        m = y[i] > m ? y[i] : m;
      }
#endif
      uint32_t mb;
      std::memcpy(&mb, &m, 4);
      if (nan || (mb & 0x7f800000u) == 0x7f800000u) {  // NaN, +inf or a row of -inf
        op[r] = -1;
        continue;
      }
      // pass 2: exponentials, their sums per vector of 16 as a running double prefix
      double total = 0.0;
      int64_t i = 0;
#if defined(__AVX512F__)
      const __m512 vm = _mm512_set1_ps(m), floor = _mm512_set1_ps(-87.3f), zero = _mm512_setzero_ps();
      for (int64_t v = 0; v < nvec; ++v, i += 16) {
        const __mmask16 lanes = i + 16 <= V ? static_cast<__mmask16>(0xffff)
                                            : static_cast<__mmask16>((1u << (V - i)) - 1);
        const __m512 d = _mm512_sub_ps(_mm512_maskz_loadu_ps(lanes, y + i), vm);
        const __mmask16 live = lanes & _mm512_cmp_ps_mask(d, floor, _CMP_GE_OQ);
        const __m512 ev = _mm512_mask_mov_ps(zero, live, exp512(d));
        _mm512_storeu_ps(ep + i, ev);
        total += static_cast<double>(_mm512_reduce_add_ps(ev));
        prefix[v] = total;
      }
#else
      for (int64_t v = 0; v < nvec; ++v) {
        float s = 0.0f;
        for (int64_t j = 0; j < 16; ++j, ++i) {
          const float d = i < V ? y[i] - m : -100.0f;
          ep[i] = d >= -87.3f ? std::exp(d) : 0.0f;
          s += ep[i];
        }
        total += s;
        prefix[v] = total;
      }
#endif
      // the target, strictly below the total (as the torch code's nextafter): lands on mass > 0
      const double target = std::min(static_cast<double>(up[r]) * total, std::nextafter(total, 0.0));
      int64_t lo = 0, hi = nvec - 1;  // the first vector whose prefix exceeds the target
      while (lo < hi) {
        const int64_t mid = (lo + hi) / 2;
        if (prefix[mid] > target) hi = mid;
        else lo = mid + 1;
      }
      double run = lo > 0 ? prefix[lo - 1] : 0.0;
      int64_t token = -1, last = -1;
      for (int64_t j = lo * 16; j < std::min(V, lo * 16 + 16); ++j) {
        if (ep[j] <= 0.0f) continue;
        last = j;
        run += ep[j];
        if (run > target) {
          token = j;
          break;
        }
      }
      // the vector's own sum rounded otherwise than this walk: its last entry of positive mass
      op[r] = token >= 0 ? token : last;
    }
  });
  return out;
}
