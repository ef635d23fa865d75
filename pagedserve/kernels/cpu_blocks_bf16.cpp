// bf16 linear layers (y = x W^T + b) of decode steps, W read from its GGUF blocks (AVX512-BF16 for
// a few rows; AMX tiles, below, for up to layers.BF16_BLOCKS_AMX_MAX_ROWS).
//
// Why: a decode step at concurrency 1 streams every weight once for one row of x. On a 2-vCPU Xeon
// with AMX (2026-12-05) oneDNN's bf16 kernels ran SmolLM2's 30 layers and LM head in ~24 ms on one
// core at 1 to 16 rows: 270 MB of bf16 weights. The default model is a GGUF file whose layers are
// Q4_1 blocks (the LM head Q8_0): 0.625 and 1.06 bytes a weight instead of 2. Here each block's
// integers q are expanded in registers to bf16 (exact: |q| <= 127) by a table lookup per 32 nibbles
// and multiplied by x's pairs with vdpbf16ps (products exact, summed in fp32); each block's sums
// are then scaled by the block's d and shifted by m times the block's sum of x:
//
//   y[r, n] = bias[n] + sum_b ( d[n, b] * sum_i x[r, 32 b + i] q[n, b, i]  +  m[n, b] * sum_i x[r, 32 b + i] )
//
// which is x times the exact weights d q + m (as the fp32 model holds them), not their bf16
// roundings; the result is rounded once to bf16 (nearest even). A row's result does not depend on
// the rows beside it. Work grows with rows (16 vdpbf16ps a block and row), memory traffic does not:
// past a few rows oneDNN's AMX kernels over the dense bf16 weights win (layers.BF16_BLOCKS_MAX_ROWS),
// unless the blocks themselves go through AMX tiles (linear_amx below: the default where it runs).
//
// Layout of one (panel p, block b) record, panels of 16 features (features past N are zero):
//   Q4_1 (320 bytes): [0, 256) eight row pairs t, 32 bytes each: byte j holds in its low nibble
//        q[n = j / 2, k = 4 t + j % 2] and in its high one q[n = j / 2, k = 4 t + 2 + j % 2];
//        [256, 288) d fp16 [16]; [288, 320) m fp16 [16].
//   Q8_0 (544 bytes): [0, 512) 16 rows r of 32 int8: byte j is q[n = j / 2, k = 2 r + j % 2];
//        [512, 544) d fp16 [16].
// so that 32 consecutive values, as bf16, are one vdpbf16ps operand: feature n's pair of k in lane n.
#include <torch/extension.h>

#include "cpu_pool.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__) && defined(__F16C__)
#include <immintrin.h>
#define PAGEDSERVE_BLOCKS_BF16 1
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>

#include "cpu_amx.h"
#define PAGEDSERVE_BLOCKS_AMX 1
#endif
#endif

namespace {

constexpr int64_t KB = 32;  // k per GGUF block
constexpr int64_t REC_Q4 = 320, REC_Q8 = 544;
constexpr int RMAX = 4;  // rows of x a pass over a panel's blocks takes

#if defined(PAGEDSERVE_BLOCKS_BF16)
// y[r, 0:cols] for R rows of x (ldx bf16 a row) against one panel's records; sums [R, blocks]: each
// block's sum of x (Q4_1's m term).
// bf16 of 0..15, twice: vpermw reads an index's low 5 bits, so a word holding a whole byte reads
// its low nibble (bit 4, the high nibble's lowest, picks the second copy, the same values)
inline __m512i nibble_table() {
  return _mm512_set_epi16(0x4170, 0x4160, 0x4150, 0x4140, 0x4130, 0x4120, 0x4110, 0x4100, 0x40e0, 0x40c0, 0x40a0,
                          0x4080, 0x4040, 0x4000, 0x3f80, 0x0000, 0x4170, 0x4160, 0x4150, 0x4140, 0x4130, 0x4120,
                          0x4110, 0x4100, 0x40e0, 0x40c0, 0x40a0, 0x4080, 0x4040, 0x4000, 0x3f80, 0x0000);
}

// A Q4_1 record's row pair t as bf16 integers: q of k = 4 t, 4 t + 1 (lo) and of k = 4 t + 2,
// 4 t + 3 (hi), feature n's pair in lane n (a vdpbf16ps operand; AMX's B rows 2 t and 2 t + 1).
inline void q4_rows(const uint8_t* rec, int t, __m512i table, __m512i& lo, __m512i& hi) {
  const __m512i bytes = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + 32 * t)));
  lo = _mm512_permutexvar_epi16(bytes, table);
  hi = _mm512_permutexvar_epi16(_mm512_srli_epi16(bytes, 4), table);
}

// A Q8_0 record's row t (k = 2 t, 2 t + 1 of each feature) as bf16 integers (exact: |q| <= 127).
inline __m512bh q8_row(const uint8_t* rec, int t) {
  const __m128i* src = reinterpret_cast<const __m128i*>(rec + 32 * t);
  const __m512 f0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(src)));
  const __m512 f1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(src + 1)));
  return _mm512_cvtne2ps_pbh(f1, f0);
}

template <int R, bool Q8>
void panel_rows(const at::BFloat16* x, int64_t ldx, const uint8_t* rec, const float* sums, int64_t blocks,
                const float* bias, at::BFloat16* y, int64_t ldy, int64_t cols) {
  const __m512i table = nibble_table();
  constexpr int C = R == 1 ? 4 : 2;  // accumulators a row: independent vdpbf16ps chains
  const __mmask16 mask = cols >= 16 ? 0xffff : static_cast<__mmask16>((1u << cols) - 1);
  const __m512 b0 = bias ? _mm512_maskz_loadu_ps(mask, bias) : _mm512_setzero_ps();
  __m512 tot[R];
  for (int r = 0; r < R; ++r) tot[r] = b0;
  auto pair = [&](int r, int64_t k) {  // x[r, k], x[r, k + 1] in every lane
    int32_t v;
    std::memcpy(&v, x + r * ldx + k, 4);
    return (__m512bh)_mm512_set1_epi32(v);
  };
  for (int64_t b = 0; b < blocks; ++b) {
    __m512 acc[R][C];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
    const int64_t k0 = b * KB;
    if constexpr (!Q8) {
      for (int t = 0; t < 8; ++t) {
        __m512i lo, hi;
        q4_rows(rec, t, table, lo, hi);
        const int c = R == 1 ? 2 * (t & 1) : 0;
        for (int r = 0; r < R; ++r) {
          acc[r][c] = _mm512_dpbf16_ps(acc[r][c], (__m512bh)lo, pair(r, k0 + 4 * t));
          acc[r][c + 1] = _mm512_dpbf16_ps(acc[r][c + 1], (__m512bh)hi, pair(r, k0 + 4 * t + 2));
        }
      }
    } else {
      for (int t = 0; t < 16; ++t) {
        const __m512bh w = q8_row(rec, t);
        const int c = R == 1 ? t & 3 : t & 1;
        for (int r = 0; r < R; ++r) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], w, pair(r, k0 + 2 * t));
      }
    }
    constexpr int64_t scale_at = Q8 ? 512 : 256;
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + scale_at)));
    for (int r = 0; r < R; ++r) {
      __m512 s = _mm512_add_ps(acc[r][0], acc[r][1]);
      if constexpr (C == 4) s = _mm512_add_ps(s, _mm512_add_ps(acc[r][2], acc[r][3]));
      tot[r] = _mm512_fmadd_ps(s, d, tot[r]);
    }
    if constexpr (!Q8) {
      const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + scale_at + 32)));
      for (int r = 0; r < R; ++r) tot[r] = _mm512_fmadd_ps(_mm512_set1_ps(sums[r * blocks + b]), m, tot[r]);
    }
    rec += Q8 ? REC_Q8 : REC_Q4;
  }
  for (int r = 0; r < R; ++r) _mm256_mask_storeu_epi16(y + r * ldy, mask, (__m256i)_mm512_cvtneps_pbh(tot[r]));
}

#if defined(PAGEDSERVE_BLOCKS_AMX)
// The same records through AMX tiles, for any number of rows (CPUs with AMX-BF16).
//
// Why: on a 2-vCPU Xeon VM with AMX (2026-12-06) oneDNN's bf16 kernels took 35-36 ms for SmolLM2's
// 30 layers and LM head at 1 to 16 rows (its 270 MB of weights at ~7.5 GB/s in that phase of the
// VM); the AVX512-BF16 loop above does 16 vdpbf16ps a block and row, so its work grows with the
// rows. Here a block of 32 k of 16 features is one B tile, its q expanded to bf16 integers (the
// same vpermw lookup, each record's row pair t being B's rows 2t and 2t + 1 in AMX's pair layout),
// and one tdpbf16ps multiplies it by up to 16 rows of x (A: x[rows, 32 b : 32 b + 32]) into a C
// tile of fresh fp32 sums. That C is stored and each row's sums scaled by d and shifted by m times
// the block's sum of x into fp32 accumulators, as above: the same exact weights, products exact,
// sums in fp32 (in another order than the loop above), one rounding to bf16; rows do not depend
// on each other. The next block is expanded, and the previous block's stored C scaled, while a
// block's tile product runs (two B buffers, two C tiles).
//
// Tiles: 0 and 4 A, 1 and 5 B, 2 and 3 C (the two stages of the pipeline); rows of A and C are the
// rows of x in this pass (<= 16), set by the tile configuration each thread loads per call.
void load_tiles(int rows) {
  pagedserve_amx::TileConfig cfg;
  for (int t : {0, 4}) cfg.rows[t] = rows, cfg.colsb[t] = 64;  // A: rows x 32 bf16
  for (int t : {1, 5}) cfg.rows[t] = 16, cfg.colsb[t] = 64;    // B: 16 k pairs x 16 features x 2
  for (int t : {2, 3}) cfg.rows[t] = rows, cfg.colsb[t] = 64;  // C: rows x 16 fp32
  pagedserve_amx::load_tile_config(cfg);
}

template <bool Q8>
void expand_block(const uint8_t* rec, uint16_t* dst) {
  if constexpr (!Q8) {
    const __m512i table = nibble_table();
    for (int t = 0; t < 8; ++t) {
      __m512i lo, hi;
      q4_rows(rec, t, table, lo, hi);
      _mm512_store_si512(dst + 64 * t, lo);
      _mm512_store_si512(dst + 64 * t + 32, hi);
    }
  } else {
    for (int t = 0; t < 16; ++t) _mm512_store_si512(dst + 32 * t, (__m512i)q8_row(rec, t));
  }
}

// y[0:rows, 0:cols] for rows <= 16 of x against one panel's records (tiles configured for `rows`)
template <bool Q8>
void panel_amx(const at::BFloat16* x, int64_t ldx, int rows, const uint8_t* rec, const float* sums, int64_t blocks,
               const float* bias, at::BFloat16* y, int64_t ldy, int64_t cols) {
  constexpr int64_t rec_bytes = Q8 ? REC_Q8 : REC_Q4, scale_at = Q8 ? 512 : 256;
  alignas(64) uint16_t bbuf[2][16 * 32];
  alignas(64) float cbuf[2][16 * 16];
  const __mmask16 mask = cols >= 16 ? 0xffff : static_cast<__mmask16>((1u << cols) - 1);
  const __m512 b0 = bias ? _mm512_maskz_loadu_ps(mask, bias) : _mm512_setzero_ps();
  __m512 acc[16];
  for (int r = 0; r < 16; ++r) acc[r] = b0;
  auto scale = [&](int64_t b, const float* c) {
    const uint8_t* rb = rec + b * rec_bytes;
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(rb + scale_at)));
    for (int r = 0; r < rows; ++r) acc[r] = _mm512_fmadd_ps(_mm512_load_ps(c + 16 * r), d, acc[r]);
    if constexpr (!Q8) {
      const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(rb + scale_at + 32)));
      for (int r = 0; r < rows; ++r) acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(sums[r * blocks + b]), m, acc[r]);
    }
  };
  expand_block<Q8>(rec, bbuf[0]);
  for (int64_t b = 0; b < blocks; ++b) {
    const char* ahead = reinterpret_cast<const char*>(rec + (b + 8) * rec_bytes);
    for (int64_t off = 0; off < rec_bytes; off += 64) _mm_prefetch(ahead + off, _MM_HINT_T0);
    if (b & 1) {
      _tile_zero(3);
      _tile_loadd(4, x + b * KB, ldx * 2);
      _tile_loadd(5, bbuf[1], 64);
      _tile_dpbf16ps(3, 4, 5);
    } else {
      _tile_zero(2);
      _tile_loadd(0, x + b * KB, ldx * 2);
      _tile_loadd(1, bbuf[0], 64);
      _tile_dpbf16ps(2, 0, 1);
    }
    if (b + 1 < blocks) expand_block<Q8>(rec + (b + 1) * rec_bytes, bbuf[(b + 1) & 1]);
    if (b > 0) scale(b - 1, cbuf[(b - 1) & 1]);
    if (b & 1)
      _tile_stored(3, cbuf[1], 64);
    else
      _tile_stored(2, cbuf[0], 64);
  }
  scale(blocks - 1, cbuf[(blocks - 1) & 1]);
  for (int r = 0; r < rows; ++r) _mm256_mask_storeu_epi16(y + r * ldy, mask, (__m256i)_mm512_cvtneps_pbh(acc[r]));
}

template <bool Q8>
void linear_amx(const at::BFloat16* x, int64_t M, int64_t K, const uint8_t* records, const float* sums,
                const float* bias, at::BFloat16* y, int64_t N) {
  const int64_t blocks = K / KB, panels = (N + 15) / 16, rec_bytes = Q8 ? REC_Q8 : REC_Q4;
  pagedserve_pool::decode_for(panels, 4, 2, [&](int64_t p0, int64_t p1) {
    int configured = 0;
    for (int64_t m0 = 0; m0 < M; m0 += 16) {  // passes of 16 rows over this unit's panels (hot in L1 / L2)
      const int rows = static_cast<int>(std::min<int64_t>(16, M - m0));
      if (rows != configured) load_tiles(configured = rows);
      for (int64_t p = p0; p < p1; ++p)
        panel_amx<Q8>(x + m0 * K, K, rows, records + p * blocks * rec_bytes, sums ? sums + m0 * blocks : nullptr,
                      blocks, bias ? bias + p * 16 : nullptr, y + m0 * N + p * 16, N,
                      std::min<int64_t>(16, N - p * 16));
    }
    _tile_release();
  });
}

// Linux hands AMX's tile state to a process only on request (arch_prctl ARCH_REQ_XCOMP_PERM for
// XTILEDATA, once per process; oneDNN asks too).
bool amx_permitted() {
  static const bool ok = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return ok;
}
#endif

template <bool Q8>
void linear_rows(const at::BFloat16* x, int64_t M, int64_t K, const uint8_t* records, const float* sums,
                 const float* bias, at::BFloat16* y, int64_t N) {
  const int64_t blocks = K / KB, panels = (N + 15) / 16, rec_bytes = Q8 ? REC_Q8 : REC_Q4;
  pagedserve_pool::decode_for(panels, 4, 2, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const uint8_t* rec = records + p * blocks * rec_bytes;
      const int64_t cols = std::min<int64_t>(16, N - p * 16);
      const float* bp = bias ? bias + p * 16 : nullptr;
      for (int64_t m0 = 0; m0 < M; m0 += RMAX) {
        const at::BFloat16* xm = x + m0 * K;
        const float* sm = sums ? sums + m0 * blocks : nullptr;
        at::BFloat16* ym = y + m0 * N + p * 16;
        switch (std::min<int64_t>(RMAX, M - m0)) {
          case 1: panel_rows<1, Q8>(xm, K, rec, sm, blocks, bp, ym, N, cols); break;
          case 2: panel_rows<2, Q8>(xm, K, rec, sm, blocks, bp, ym, N, cols); break;
          case 3: panel_rows<3, Q8>(xm, K, rec, sm, blocks, bp, ym, N, cols); break;
          default: panel_rows<4, Q8>(xm, K, rec, sm, blocks, bp, ym, N, cols); break;
        }
      }
    }
  });
}
#endif

}  // namespace

bool blocks_bf16_available() {
#if defined(PAGEDSERVE_BLOCKS_BF16)
  return true;
#else
  return false;
#endif
}

// whether linear_blocks_bf16 runs on AMX tiles here (built for AMX-BF16, and Linux granted the tiles)
bool blocks_amx_available() {
#if defined(PAGEDSERVE_BLOCKS_AMX)
  return amx_permitted();
#else
  return false;
#endif
}

// y [M, N] = x [M, K] W^T + bias for bf16 x, W in the records above (`q8`: Q8_0, else Q4_1), as a
// uint8 tensor [ceil(N / 16), K / 32, record bytes]; bias fp32 [N] or none. On AMX tiles where
// blocks_amx_available() and `use_amx`, else the AVX512-BF16 loop.
at::Tensor linear_blocks_bf16(const at::Tensor& x, const at::Tensor& records, const c10::optional<at::Tensor>& bias,
                              int64_t N, bool q8, bool use_amx) {
#if defined(PAGEDSERVE_BLOCKS_BF16)
  TORCH_CHECK(x.scalar_type() == at::kBFloat16, "linear_blocks_bf16: bf16 x");
  TORCH_CHECK(records.scalar_type() == at::kByte && records.dim() == 3 && records.is_contiguous() &&
                  records.size(2) == (q8 ? REC_Q8 : REC_Q4),
              "linear_blocks_bf16: bad block layout");
  const int64_t panels = records.size(0), blocks = records.size(1), K = blocks * KB;
  TORCH_CHECK(x.size(-1) == K, "linear_blocks_bf16: x has ", x.size(-1), " features, the weight ", K);
  TORCH_CHECK(N > (panels - 1) * 16 && N <= panels * 16, "linear_blocks_bf16: N does not match the panels");
  const at::Tensor xc = x.reshape({-1, K}).contiguous();
  const int64_t M = xc.size(0);
  at::Tensor bc;
  if (bias.has_value() && bias->defined()) {
    bc = bias->to(at::kFloat).contiguous();
    TORCH_CHECK(bc.numel() == N, "linear_blocks_bf16: bias must have N values");
  }
  std::vector<int64_t> out_shape(x.sizes().begin(), x.sizes().end());
  out_shape.back() = N;
  at::Tensor y = at::empty({M, N}, xc.options());
  if (M == 0) return y.view(out_shape);
  const auto* xp = xc.data_ptr<at::BFloat16>();
  const float* bp = bc.defined() ? bc.data_ptr<float>() : nullptr;
#if defined(PAGEDSERVE_BLOCKS_AMX)
  const bool amx = use_amx && amx_permitted();
#else
  const bool amx = false && use_amx;
#endif
  auto run = [&](auto q8_tag, const float* sums) {
    constexpr bool Q8 = decltype(q8_tag)::value;
#if defined(PAGEDSERVE_BLOCKS_AMX)
    if (amx) return linear_amx<Q8>(xp, M, K, records.data_ptr<uint8_t>(), sums, bp, y.data_ptr<at::BFloat16>(), N);
#endif
    linear_rows<Q8>(xp, M, K, records.data_ptr<uint8_t>(), sums, bp, y.data_ptr<at::BFloat16>(), N);
  };
  (void)amx;
  if (q8) {
    run(std::true_type{}, nullptr);
  } else {
    // Q4_1's m term: each block's sum of x in fp32 [M, blocks]
    std::vector<float> sums(M * blocks);
    const uint16_t* xu = reinterpret_cast<const uint16_t*>(xp);
    for (int64_t i = 0; i < M * blocks; ++i) {
      const __m512i w = _mm512_loadu_si512(xu + i * KB);  // 32 bf16 -> fp32: the high half of each lane
      const __m512 lo = _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
      const __m512 hi = _mm512_castsi512_ps(_mm512_and_si512(w, _mm512_set1_epi32(static_cast<int>(0xffff0000u))));
      sums[i] = _mm512_reduce_add_ps(_mm512_add_ps(lo, hi));
    }
    run(std::false_type{}, sums.data());
  }
  return y.view(out_shape);
#else
  TORCH_CHECK(false, "linear_blocks_bf16: built without AVX512-BF16");
  return x;
#endif
}
