// Paged decode attention on CPU: one query token per sequence, KV read in place through the block
// table (no gather into a workspace). The torch reference (reference.py) is its oracle.
//
// Layout (as reference.py): q [B, Hq, D]; k_cache, v_cache [num_blocks, block_size, Hkv, D];
// block_tables int32 [B, max_blocks]; seq_lens int32 [B] (KV length including this token).
// Query head h reads KV head h / (Hq / Hkv). Token positions p < seq_len are visible, and
// p >= seq_len - window when window > 0. One task per sequence. Two passes over its keys (scores,
// then the weighted sum of V), accumulated in fp32. A sequence with no visible key gets zeros.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "cpu_vec.h"

namespace {

inline float load(const float* p, int64_t i) { return p[i]; }
inline float load(const at::BFloat16* p, int64_t i) {
  uint32_t bits = static_cast<uint32_t>(reinterpret_cast<const uint16_t*>(p)[i]) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}
inline float load(const at::Half* p, int64_t i) { return static_cast<float>(p[i]); }

// A row of D values as fp32 into dst (the compiler vectorizes these loops).
template <typename T>
inline void to_float(const T* src, float* dst, int64_t D) {
  for (int64_t d = 0; d < D; ++d) dst[d] = load(src, d);
}


#if defined(__AVX512F__)
// Lane i of the result is the sum of the 16 lanes of v[i]: a shuffle tree, far cheaper than 16
// separate horizontal sums (one per key, the cost that dominated the plain loop).
inline __m512 hsum16(const __m512* v) {
  __m512 t[8], u[4], w[2];
  for (int i = 0; i < 8; ++i)
    t[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i)
    u[i] = _mm512_add_ps(_mm512_shuffle_ps(t[2 * i], t[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(t[2 * i], t[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  for (int i = 0; i < 2; ++i)
    w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(w[0], w[1], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(w[0], w[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

template <typename T>
constexpr bool kVectorized = std::is_same_v<T, float> || std::is_same_v<T, at::BFloat16>;

// Scores of keys [t0, t1) of one block (at most 16) for every query head: q . k, 16 keys at once.
template <typename T>
inline void block_scores(const float* qf, const T* blk, int64_t first_row, int64_t t0, int64_t t1,
                         int64_t start, int64_t n, int64_t Hkv, int64_t G, int64_t D, float* scores) {
  const int64_t nc = D / 16, count = t1 - t0, row_stride = Hkv * D;
  __m512 part[16];
  for (int64_t h = 0; h < Hkv; ++h) {
    for (int64_t g = 0; g < G; ++g) {
      const float* qh = qf + (h * G + g) * D;
      for (int64_t i = 0; i < 16; ++i) {
        if (i >= count) {
          part[i] = _mm512_setzero_ps();
          continue;
        }
        const T* k = blk + (first_row + i) * row_stride + h * D;
        __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(qh), load16(k));
        for (int64_t c = 1; c < nc; ++c) acc = _mm512_fmadd_ps(_mm512_loadu_ps(qh + 16 * c), load16(k + 16 * c), acc);
        part[i] = acc;
      }
      const __mmask16 mask = count >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << count) - 1);
      _mm512_mask_storeu_ps(scores + (h * G + g) * n + (t0 - start), mask, hsum16(part));
    }
  }
}
#else
template <typename T>
constexpr bool kVectorized = false;
#endif

// scores[i] <- exp(scores[i] - max); returns the sum.
inline float exp_shifted(float* scores, int64_t n) {
  float m = scores[0];
  for (int64_t i = 1; i < n; ++i) m = std::max(m, scores[i]);
  float sum = 0.0f;
  int64_t i = 0;
#if defined(__AVX512F__)
  __m512 vsum = _mm512_setzero_ps();
  const __m512 vm = _mm512_set1_ps(m);
  for (; i + 16 <= n; i += 16) {
    __m512 e = exp512(_mm512_sub_ps(_mm512_loadu_ps(scores + i), vm));
    _mm512_storeu_ps(scores + i, e);
    vsum = _mm512_add_ps(vsum, e);
  }
  sum = _mm512_reduce_add_ps(vsum);
#elif defined(__AVX2__) && defined(__FMA__)
  __m256 vsum = _mm256_setzero_ps();
  const __m256 vm = _mm256_set1_ps(m);
  for (; i + 8 <= n; i += 8) {
    __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(scores + i), vm));
    _mm256_storeu_ps(scores + i, e);
    vsum = _mm256_add_ps(vsum, e);
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, vsum);
  for (float l : lanes) sum += l;
#endif
  for (; i < n; ++i) {
    scores[i] = std::exp(scores[i] - m);
    sum += scores[i];
  }
  return sum;
}

// Ask for a block's rows ahead of use: blocks sit at random places in the pool, so the hardware
// prefetcher, which follows streams within a page, cannot guess the next one.
inline void prefetch(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(c + off, 0, 1);
}

// The shapes, strides and pointers of one paged_decode call (layout above), and the steps every
// kernel takes per sequence: its visible keys, its blocks, its output rows.
template <typename T>
struct Paged {
  int64_t B, Hq, D, num_blocks, bs, Hkv, G, max_blocks, qs_b, qs_h, os_b, os_h, row_stride, block_stride;
  const T* qp;
  const T* kp;
  const T* vp;
  const int32_t* tables;
  const int32_t* lens;
  T* op;

  Paged(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& block_tables,
        const at::Tensor& seq_lens, at::Tensor& out)
      : B(q.size(0)), Hq(q.size(1)), D(q.size(2)), num_blocks(k_cache.size(0)), bs(k_cache.size(1)),
        Hkv(k_cache.size(2)), G(Hq / Hkv), max_blocks(block_tables.size(1)), qs_b(q.stride(0)),
        qs_h(q.stride(1)), os_b(out.stride(0)), os_h(out.stride(1)), row_stride(Hkv * D),
        block_stride(bs * Hkv * D), qp(q.data_ptr<T>()), kp(k_cache.data_ptr<T>()), vp(v_cache.data_ptr<T>()),
        tables(block_tables.data_ptr<int32_t>()), lens(seq_lens.data_ptr<int32_t>()), op(out.data_ptr<T>()) {}

  // The first key sequence b sees (its last is lens[b] - 1): all of them, or the window's.
  int64_t first_key(int64_t b, int64_t window) const {
    return window > 0 ? std::max<int64_t>(0, lens[b] - window) : 0;
  }

  // The output rows of a sequence that sees no key: zeros.
  void store_zeros(int64_t b) const {
    for (int64_t h = 0; h < Hq; ++h)
      for (int64_t d = 0; d < D; ++d) op[b * os_b + h * os_h + d] = T(0.0f);
  }

  // The pool index of entry j of sequence b's block table, clamped into the pool.
  int64_t block(int64_t b, int64_t j) const {
    return std::min<int64_t>(std::max<int32_t>(tables[b * max_blocks + j], 0), num_blocks - 1);
  }

  // Sequence b's output rows: acc [Hq, D], each head's row times inv[head].
  void store(int64_t b, const float* acc, const float* inv) const {
    for (int64_t hq = 0; hq < Hq; ++hq)
      for (int64_t d = 0; d < D; ++d) op[b * os_b + hq * os_h + d] = T(acc[hq * D + d] * inv[hq]);
  }
};

template <typename T>
void decode(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
            const at::Tensor& block_tables, const at::Tensor& seq_lens, at::Tensor& out, double scale,
            int64_t window) {
  const Paged<T> pg(q, k_cache, v_cache, block_tables, seq_lens, out);
  const int64_t B = pg.B, Hq = pg.Hq, D = pg.D, bs = pg.bs, Hkv = pg.Hkv, G = pg.G;
  const int64_t row_stride = pg.row_stride, block_stride = pg.block_stride;
  const float fscale = static_cast<float>(scale);

  // One task per sequence: its blocks are read whole and in order (K, then V), every KV head of a
  // token row at once, each K or V row widened once for the G query heads that read it.
  at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(Hq * D), acc(Hq * D), row(Hkv * D), scores, inv(Hq);
    for (int64_t b = begin; b < end; ++b) {
      const int64_t len = pg.lens[b], start = pg.first_key(b, window), n = len - start;
      if (n <= 0) {
        pg.store_zeros(b);
        continue;
      }
      for (int64_t h = 0; h < Hq; ++h) {
        to_float(pg.qp + b * pg.qs_b + h * pg.qs_h, qf.data() + h * D, D);
        for (int64_t d = 0; d < D; ++d) qf[h * D + d] *= fscale;
      }
      scores.resize(Hq * n);
      const int64_t first_block = start / bs, last_block = (len - 1) / bs;
      for (int pass = 0; pass < 2; ++pass) {
        const T* cache = pass == 0 ? pg.kp : pg.vp;
        if (pass == 1) std::fill(acc.begin(), acc.end(), 0.0f);
        for (int64_t j = first_block; j <= last_block; ++j) {
          const T* blk = cache + pg.block(b, j) * block_stride;
          if (j < last_block) prefetch(cache + pg.block(b, j + 1) * block_stride, block_stride * sizeof(T));
          const int64_t t0 = std::max(start, j * bs), t1 = std::min(len, (j + 1) * bs);
#if defined(__AVX512F__)
          if constexpr (kVectorized<T>) {
            if (pass == 0 && D % 16 == 0 && D <= 256) {
              for (int64_t c0 = t0; c0 < t1; c0 += 16)
                block_scores(qf.data(), blk, c0 - j * bs, c0, std::min(t1, c0 + 16), start, n, Hkv, G, D,
                             scores.data());
              continue;
            }
          }
#endif
          for (int64_t t = t0; t < t1; ++t) {
            to_float(blk + (t - j * bs) * row_stride, row.data(), Hkv * D);
            for (int64_t hq = 0; hq < Hq; ++hq) {
              const float* r = row.data() + (hq / G) * D;
              if (pass == 0) {
                const float* qh = qf.data() + hq * D;
                float s = 0.0f;
#pragma omp simd reduction(+ : s)
                for (int64_t d = 0; d < D; ++d) s += qh[d] * r[d];
                scores[hq * n + (t - start)] = s;
              } else {
                const float p = scores[hq * n + (t - start)];
                float* ah = acc.data() + hq * D;
#pragma omp simd
                for (int64_t d = 0; d < D; ++d) ah[d] += p * r[d];
              }
            }
          }
        }
        if (pass == 0)
          for (int64_t hq = 0; hq < Hq; ++hq) inv[hq] = 1.0f / exp_shifted(scores.data() + hq * n, n);
      }
      pg.store(b, acc.data(), inv.data());
    }
  });
}

#if defined(__AVX512BF16__)
// bf16 decode with AVX512-BF16. q . k as bf16 pair dot products (vdpbf16ps: products exact, sums
// in fp32; the scale is applied to the sums), 16 keys of one KV head a time reduced by hsum16; no
// widening of K at all. P . V in fp32, the accumulators of a KV head's query heads held in registers
// over the tokens of a block (the generic loop above kept them in memory: a load and a store per
// FMA). The next block is prefetched a slice per query head (a whole block at once stalled on the
// fill buffers: 29% of the kernel's samples sat on prefetches). SmolLM2's shapes (9 query / 3 KV
// heads, D 64), batch 16 at 300 tokens, one thread, against the generic loop: 737 -> 264-322 us a
// layer with KV in cache, 28.2 -> 13.2 ms for 30 layers over blocks at random places in the pool;
// in a served decode step of batch 16 the attention went from 37.6 to 19.1 ms.
inline __m512bh load_bh(const at::BFloat16* p) {
  return reinterpret_cast<__m512bh>(_mm512_loadu_si512(reinterpret_cast<const void*>(p)));
}

// Scores of up to 16 keys (rows of k, `count` of them) for one query head: lane i of the result is
// q . k_i. NC chunks of 32 (D = 32 NC), unrolled at compile time; q stays in registers.
template <int NC>
inline __m512 scores16(const at::BFloat16* q, const at::BFloat16* k, int64_t row_stride, int64_t count) {
  __m512bh qv[NC];
  for (int c = 0; c < NC; ++c) qv[c] = load_bh(q + 32 * c);
  __m512 part[16];
  for (int64_t i = 0; i < 16; ++i) {
    __m512 s = _mm512_setzero_ps();
    if (i < count)
      for (int c = 0; c < NC; ++c) s = _mm512_dpbf16_ps(s, qv[c], load_bh(k + i * row_stride + 32 * c));
    part[i] = s;
  }
  return hsum16(part);
}

// acc[g * D + 16 c ..] += sum over t < count of p[g * n + t] * v[t * row_stride + 16 c ..], for
// g < GN query heads and c < CH chunks of 16: GN * CH independent accumulators in registers (one
// chain per head would wait on the FMA latency every token).
template <int GN, int CH>
inline void pv_tile(float* acc, int64_t D, const at::BFloat16* v, int64_t row_stride, const float* p, int64_t n,
                    int64_t count) {
  __m512 a[GN][CH];
  for (int g = 0; g < GN; ++g)
    for (int c = 0; c < CH; ++c) a[g][c] = _mm512_loadu_ps(acc + g * D + 16 * c);
  for (int64_t t = 0; t < count; ++t) {
    __m512 x[CH];
    for (int c = 0; c < CH; ++c) x[c] = load16(v + t * row_stride + 16 * c);
    for (int g = 0; g < GN; ++g) {
      const __m512 pg = _mm512_set1_ps(p[g * n + t]);
      for (int c = 0; c < CH; ++c) a[g][c] = _mm512_fmadd_ps(pg, x[c], a[g][c]);
    }
  }
  for (int g = 0; g < GN; ++g)
    for (int c = 0; c < CH; ++c) _mm512_storeu_ps(acc + g * D + 16 * c, a[g][c]);
}

template <int CH>
inline void pv_heads(int64_t gn, float* acc, int64_t D, const at::BFloat16* v, int64_t row_stride, const float* p,
                     int64_t n, int64_t count) {
  switch (gn) {
    case 1: pv_tile<1, CH>(acc, D, v, row_stride, p, n, count); break;
    case 2: pv_tile<2, CH>(acc, D, v, row_stride, p, n, count); break;
    case 3: pv_tile<3, CH>(acc, D, v, row_stride, p, n, count); break;
    default: pv_tile<4, CH>(acc, D, v, row_stride, p, n, count); break;
  }
}

inline bool bf16_dot_head_dim(int64_t D) { return D == 32 || D == 64 || D == 96 || D == 128 || D == 256; }

void decode_bf16(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                 const at::Tensor& block_tables, const at::Tensor& seq_lens, at::Tensor& out, double scale,
                 int64_t window) {
  using T = at::BFloat16;
  const Paged<T> pg(q, k_cache, v_cache, block_tables, seq_lens, out);
  const int64_t B = pg.B, Hq = pg.Hq, D = pg.D, bs = pg.bs, Hkv = pg.Hkv, G = pg.G;
  const int64_t row_stride = pg.row_stride, block_stride = pg.block_stride;
  const int64_t qs_h = pg.qs_h;  // locals: the vector stores below may alias pg's fields
  const T* kp = pg.kp;
  const T* vp = pg.vp;
  const __m512 vscale = _mm512_set1_ps(static_cast<float>(scale));
  const int64_t nc = D / 32, ch = (D / 16) % 4 == 0 ? 4 : 2;  // D % 32 == 0
  const int64_t block_lines = (block_stride * static_cast<int64_t>(sizeof(T)) + 63) / 64;
  // part i of `parts` of the block at p, asked for ahead of use: blocks sit at random places in
  // the pool, and one prefetch burst of a whole block stalls on the fill buffers
  auto prefetch_part = [block_lines](const T* p, int64_t i, int64_t parts) {
    const char* c = reinterpret_cast<const char*>(p);
    for (int64_t l = block_lines * i / parts; l < block_lines * (i + 1) / parts; ++l)
      __builtin_prefetch(c + 64 * l, 0, 3);
  };

  at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(Hq * D), scores, inv(Hq);
    for (int64_t b = begin; b < end; ++b) {
      const int64_t len = pg.lens[b], start = pg.first_key(b, window), n = len - start;
      if (n <= 0) {
        pg.store_zeros(b);
        continue;
      }
      const T* qb = pg.qp + b * pg.qs_b;
      scores.resize(Hq * n);
      const int64_t first_block = start / bs, last_block = (len - 1) / bs;
      for (int64_t j = first_block; j <= last_block; ++j) {  // scores
        const T* blk = kp + pg.block(b, j) * block_stride;
        // ahead: the next K block, or after the last one the first V block
        const T* next = (j < last_block ? kp + pg.block(b, j + 1) * block_stride
                                        : vp + pg.block(b, first_block) * block_stride);
        const int64_t t0 = std::max(start, j * bs), t1 = std::min(len, (j + 1) * bs);
        for (int64_t c0 = t0; c0 < t1; c0 += 16) {
          const int64_t count = std::min<int64_t>(t1 - c0, 16);
          const __mmask16 mask = count >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << count) - 1);
          const T* rows = blk + (c0 - j * bs) * row_stride;
          for (int64_t hq = 0; hq < Hq; ++hq) {
            prefetch_part(next, hq, Hq);
            const T* qh = qb + hq * qs_h;
            const T* kh = rows + (hq / G) * D;
            __m512 s;
            switch (nc) {
              case 1: s = scores16<1>(qh, kh, row_stride, count); break;
              case 2: s = scores16<2>(qh, kh, row_stride, count); break;
              case 3: s = scores16<3>(qh, kh, row_stride, count); break;
              case 4: s = scores16<4>(qh, kh, row_stride, count); break;
              default: s = scores16<8>(qh, kh, row_stride, count); break;
            }
            _mm512_mask_storeu_ps(scores.data() + hq * n + (c0 - start), mask, _mm512_mul_ps(s, vscale));
          }
        }
      }
      for (int64_t hq = 0; hq < Hq; ++hq) inv[hq] = 1.0f / exp_shifted(scores.data() + hq * n, n);
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t j = first_block; j <= last_block; ++j) {  // P . V
        const T* blk = vp + pg.block(b, j) * block_stride;
        const T* next = j < last_block ? vp + pg.block(b, j + 1) * block_stride : nullptr;
        const int64_t t0 = std::max(start, j * bs), t1 = std::min(len, (j + 1) * bs);
        const T* rows = blk + (t0 - j * bs) * row_stride;
        for (int64_t h = 0; h < Hkv; ++h) {
          if (next) prefetch_part(next, h, Hkv);
          for (int64_t g0 = 0; g0 < G; g0 += 4) {
            const int64_t gn = std::min<int64_t>(4, G - g0);
            const float* p = scores.data() + (h * G + g0) * n + (t0 - start);
            for (int64_t c = 0; c < D / 16; c += ch) {
              float* a = acc.data() + (h * G + g0) * D + 16 * c;
              const T* v = rows + h * D + 16 * c;
              if (ch == 4) pv_heads<4>(gn, a, D, v, row_stride, p, n, t1 - t0);
              else pv_heads<2>(gn, a, D, v, row_stride, p, n, t1 - t0);
            }
          }
        }
      }
      pg.store(b, acc.data(), inv.data());
    }
  });
}
#endif

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
// fp32 decode on AVX2 (CPUs without AVX-512: the generic loop above widened every K and V row
// into a buffer and reduced each score horizontally on its own). q . k for 8 keys of one query
// head at once, reduced by one hadd tree; P . V with the accumulators of up to 4 query heads of a
// KV head in registers over the tokens of a block, 16 features a pass.
inline __m256 hsum8(const __m256* v) {
  const __m256 t0 = _mm256_hadd_ps(v[0], v[1]), t1 = _mm256_hadd_ps(v[2], v[3]);
  const __m256 t2 = _mm256_hadd_ps(v[4], v[5]), t3 = _mm256_hadd_ps(v[6], v[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// lane i: q . k_i for the `count` (<= 8) rows of k; q is D = 8 NC floats, kept in registers
template <int NC>
inline __m256 scores8(const float* q, const float* k, int64_t row_stride, int64_t count) {
  __m256 qv[NC];
  for (int c = 0; c < NC; ++c) qv[c] = _mm256_loadu_ps(q + 8 * c);
  __m256 part[8];
  for (int64_t i = 0; i < 8; ++i) {
    __m256 s = _mm256_setzero_ps();
    if (i < count)
      for (int c = 0; c < NC; ++c) s = _mm256_fmadd_ps(qv[c], _mm256_loadu_ps(k + i * row_stride + 8 * c), s);
    part[i] = s;
  }
  return hsum8(part);
}

// acc[g * D + 0..15] += sum over t < count of p[g * n + t] * v[t * row_stride + 0..15], g < GN
template <int GN>
inline void pv16(float* acc, int64_t D, const float* v, int64_t row_stride, const float* p, int64_t n,
                 int64_t count) {
  __m256 a[GN][2];
  for (int g = 0; g < GN; ++g) {
    a[g][0] = _mm256_loadu_ps(acc + g * D);
    a[g][1] = _mm256_loadu_ps(acc + g * D + 8);
  }
  for (int64_t t = 0; t < count; ++t) {
    const __m256 x0 = _mm256_loadu_ps(v + t * row_stride), x1 = _mm256_loadu_ps(v + t * row_stride + 8);
    for (int g = 0; g < GN; ++g) {
      const __m256 pg = _mm256_broadcast_ss(p + g * n + t);
      a[g][0] = _mm256_fmadd_ps(pg, x0, a[g][0]);
      a[g][1] = _mm256_fmadd_ps(pg, x1, a[g][1]);
    }
  }
  for (int g = 0; g < GN; ++g) {
    _mm256_storeu_ps(acc + g * D, a[g][0]);
    _mm256_storeu_ps(acc + g * D + 8, a[g][1]);
  }
}

inline bool f32_avx2_head_dim(int64_t D) { return D % 16 == 0 && (D <= 128 || D == 256); }

void decode_f32_avx2(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                     const at::Tensor& block_tables, const at::Tensor& seq_lens, at::Tensor& out, double scale,
                     int64_t window) {
  using T = float;
  const Paged<T> pg(q, k_cache, v_cache, block_tables, seq_lens, out);
  const int64_t B = pg.B, Hq = pg.Hq, D = pg.D, bs = pg.bs, Hkv = pg.Hkv, G = pg.G;
  const int64_t row_stride = pg.row_stride, block_stride = pg.block_stride;
  const float fscale = static_cast<float>(scale);
  const int64_t nc = D / 8;

  at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(Hq * D), acc(Hq * D), scores, inv(Hq);
    for (int64_t b = begin; b < end; ++b) {
      const int64_t len = pg.lens[b], start = pg.first_key(b, window), n = len - start;
      if (n <= 0) {
        pg.store_zeros(b);
        continue;
      }
      for (int64_t h = 0; h < Hq; ++h)
        for (int64_t d = 0; d < D; ++d) qf[h * D + d] = pg.qp[b * pg.qs_b + h * pg.qs_h + d] * fscale;
      scores.resize(Hq * n);
      const int64_t first_block = start / bs, last_block = (len - 1) / bs;
      for (int64_t j = first_block; j <= last_block; ++j) {  // scores
        const T* blk = pg.kp + pg.block(b, j) * block_stride;
        if (j < last_block) prefetch(pg.kp + pg.block(b, j + 1) * block_stride, block_stride * sizeof(T));
        else prefetch(pg.vp + pg.block(b, first_block) * block_stride, block_stride * sizeof(T));
        const int64_t t0 = std::max(start, j * bs), t1 = std::min(len, (j + 1) * bs);
        for (int64_t c0 = t0; c0 < t1; c0 += 8) {
          const int64_t count = std::min<int64_t>(t1 - c0, 8);
          const T* rows = blk + (c0 - j * bs) * row_stride;
          for (int64_t hq = 0; hq < Hq; ++hq) {
            const float* qh = qf.data() + hq * D;
            const T* kh = rows + (hq / G) * D;
            __m256 sv;
            switch (nc) {
              case 2: sv = scores8<2>(qh, kh, row_stride, count); break;
              case 4: sv = scores8<4>(qh, kh, row_stride, count); break;
              case 6: sv = scores8<6>(qh, kh, row_stride, count); break;
              case 8: sv = scores8<8>(qh, kh, row_stride, count); break;
              case 10: sv = scores8<10>(qh, kh, row_stride, count); break;
              case 12: sv = scores8<12>(qh, kh, row_stride, count); break;
              case 14: sv = scores8<14>(qh, kh, row_stride, count); break;
              case 16: sv = scores8<16>(qh, kh, row_stride, count); break;
              default: sv = scores8<32>(qh, kh, row_stride, count); break;
            }
            alignas(32) float lane[8];
            _mm256_store_ps(lane, sv);
            std::memcpy(scores.data() + hq * n + (c0 - start), lane, count * sizeof(float));
          }
        }
      }
      for (int64_t hq = 0; hq < Hq; ++hq) inv[hq] = 1.0f / exp_shifted(scores.data() + hq * n, n);
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t j = first_block; j <= last_block; ++j) {  // P . V
        const T* blk = pg.vp + pg.block(b, j) * block_stride;
        if (j < last_block) prefetch(pg.vp + pg.block(b, j + 1) * block_stride, block_stride * sizeof(T));
        const int64_t t0 = std::max(start, j * bs), t1 = std::min(len, (j + 1) * bs);
        const T* rows = blk + (t0 - j * bs) * row_stride;
        for (int64_t h = 0; h < Hkv; ++h)
          for (int64_t g0 = 0; g0 < G; g0 += 4) {
            const int64_t gn = std::min<int64_t>(4, G - g0);
            const float* p = scores.data() + (h * G + g0) * n + (t0 - start);
            for (int64_t c = 0; c < D; c += 16) {
              float* a = acc.data() + (h * G + g0) * D + c;
              const T* v = rows + h * D + c;
              switch (gn) {
                case 1: pv16<1>(a, D, v, row_stride, p, n, t1 - t0); break;
                case 2: pv16<2>(a, D, v, row_stride, p, n, t1 - t0); break;
                case 3: pv16<3>(a, D, v, row_stride, p, n, t1 - t0); break;
                default: pv16<4>(a, D, v, row_stride, p, n, t1 - t0); break;
              }
            }
          }
      }
      pg.store(b, acc.data(), inv.data());
    }
  });
}
#endif

}  // namespace

at::Tensor paged_decode(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                        const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale,
                        int64_t window) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(), "bad shapes");
  TORCH_CHECK(q.stride(2) == 1 && k_cache.is_contiguous() && v_cache.is_contiguous(), "bad strides");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && k_cache.scalar_type() == v_cache.scalar_type(),
              "q and the caches must share a dtype");
  TORCH_CHECK(q.size(1) % k_cache.size(2) == 0, "query heads must be a multiple of KV heads");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt,
              "block_tables and seq_lens must be int32");
  TORCH_CHECK(block_tables.is_contiguous() && seq_lens.is_contiguous(), "tables must be contiguous");
  at::Tensor out = at::empty_like(q, q.options().memory_format(at::MemoryFormat::Contiguous));
  switch (q.scalar_type()) {
    case at::kFloat:
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
      if (f32_avx2_head_dim(q.size(2))) {
        decode_f32_avx2(q, k_cache, v_cache, block_tables, seq_lens, out, scale, window);
        break;
      }
#endif
      decode<float>(q, k_cache, v_cache, block_tables, seq_lens, out, scale, window);
      break;
    case at::kBFloat16:
#if defined(__AVX512BF16__)
      if (bf16_dot_head_dim(q.size(2))) {
        decode_bf16(q, k_cache, v_cache, block_tables, seq_lens, out, scale, window);
        break;
      }
#endif
      decode<at::BFloat16>(q, k_cache, v_cache, block_tables, seq_lens, out, scale, window);
      break;
    case at::kHalf:
      decode<at::Half>(q, k_cache, v_cache, block_tables, seq_lens, out, scale, window);
      break;
    default:
      TORCH_CHECK(false, "paged_decode: unsupported dtype ", q.scalar_type());
  }
  return out;
}

// cpu_ops.cpp
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
void fused_add_rms_norm(at::Tensor& x, at::Tensor& residual, const at::Tensor& weight, double eps);
void rotary_neox(const at::Tensor& positions, at::Tensor& query, at::Tensor& key, const at::Tensor& cos_sin_cache,
                 int64_t head_dim);
at::Tensor silu_and_mul(const at::Tensor& x);
void write_kv(const at::Tensor& key, const at::Tensor& value, at::Tensor& k_cache, at::Tensor& v_cache,
              const at::Tensor& slot_mapping);
// cpu_gemm.cpp
bool gemm_available();
bool gemm_bf16_available();
at::Tensor pack_linear(const at::Tensor& weight);
at::Tensor linear_packed(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                         int64_t N);
// cpu_prefill.cpp
bool prefill_bf16_available();
at::Tensor paged_prefill(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                         const at::Tensor& table, int64_t seq_len, double scale, int64_t window);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode, "paged decode attention over KV read in place (CPU)");
  m.def("rms_norm", &rms_norm, "Llama RMSNorm of each row");
  m.def("fused_add_rms_norm", &fused_add_rms_norm, "residual += x; x = RMSNorm(residual), in place");
  m.def("rotary_neox", &rotary_neox, "NeoX rotary embedding of query and key, in place");
  m.def("silu_and_mul", &silu_and_mul, "silu(x[:, :d]) * x[:, d:]");
  m.def("write_kv", &write_kv, "store K/V rows at their slots of the paged pools");
  m.def("prefill_bf16_available", &prefill_bf16_available, "whether the AVX512-BF16 prefill attention was built");
  m.def("paged_prefill", &paged_prefill, "one sequence's prefill chunk attending to its paged KV (bf16)");
  m.def("gemm_available", &gemm_available, "whether the AVX2 fp32 linear kernel was built");
  m.def("gemm_bf16_available", &gemm_bf16_available, "whether the AVX512-BF16 bf16 linear kernel was built");
  m.def("pack_linear", &pack_linear, "a weight [N, K] packed into panels (fp32: 16 features, bf16: 32 x 2 k)");
  m.def("linear_packed", &linear_packed, "x W^T + b with W packed by pack_linear (fp32 AVX2, bf16 AVX512-BF16)");
}
