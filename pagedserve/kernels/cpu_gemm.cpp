// fp32 linear layers (y = x W^T + b) on AVX2 + FMA CPUs, with the weight packed once into panels.
//
// Why: on an AVX2-only CPU (AMD EPYC Zen 3, one core) torch's fp32 paths stream the weights of a
// decode step of one row at 3-7 GB/s (oneDNN's kernels on prepacked weights, MKL for F.linear),
// where the core reads 10 GB/s. The kernel below keeps a 6 x 16 tile of y in 12 ymm registers and
// streams a panel of 16 output features (K x 16 floats, laid out in the order the kernel reads
// them) once from memory per call, reusing it from cache for every group of 6 rows. On the Zen 3
// core it beat oneDNN (AVX2, prepacked weights) at every row count of SmolLM2's layers, 1-1024
// (layers.GEMM_MAX_ROWS gives the figures).
//
// Layout: packed [ceil(N / 16), K, 16]: panel p holds W[16 p + j, k] at (p, k, j); the features
// past N are zero. Sums over k run in order with FMA (results differ from MKL's by rounding).
//
// bf16 on CPUs with AVX512-BF16 (and no AMX, whose tiles oneDNN uses): the same design with
// vdpbf16ps, which adds the products of two k's into each fp32 sum: panels of 32 features (2 zmm
// of sums a row), tiles of up to 12 rows (24 accumulators), layout [ceil(N / 32), ceil(K / 2), 32, 2]
// (panel p holds W[32 p + j, 2 i + t] at (p, i, j, t); zeros past N and K). oneDNN's bf16 brgemm
// on prepacked weights streamed a decode step's weights at ~25 GB/s on one Zen 5 core at 1 row
// and reached ~220 GFLOP/s at 16. Sums are fp32; the result, with the bias added in fp32, is
// rounded once to bf16 (nearest even), as oneDNN does.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "cpu_pool.h"

#include <algorithm>
#include <cstdint>
#include <cstring>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define PAGEDSERVE_GEMM 1
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)  // implies AVX2: immintrin.h
#define PAGEDSERVE_GEMM_BF16 1
#endif

namespace {

constexpr int64_t NR = 16;   // output features per panel (2 ymm)
constexpr int64_t MR = 6;    // rows per tile: 12 accumulators + 2 panel vectors + 1 broadcast
constexpr int64_t KC = 512;  // k per pass: a panel slice of 32 KB stays in L1/L2 across a row block
constexpr int64_t MC = 96;   // rows per block: 96 x KC floats of x (192 KB) stay in L2
// Up to MC rows (decode): each panel in even passes of at most KD k, a slice of <= 16 KB that stays
// in L1 for all of the panel's row tiles, while those tiles prefetch the next slice between them.
constexpr int64_t KD = 256;
constexpr int64_t PF_MIN_ROWS = 4;  // below, one tile streams the panel and the prefetcher suffices

#if defined(PAGEDSERVE_GEMM)
// y[m, 0:16] (+)= sum over k < kc of x[m, k] * panel[k, 0:16] for m < R (R <= MR). `first`: the
// tile starts from the bias (or zero) instead of y. The first `pf_n` k steps each prefetch one
// 64-byte line from `pf` on (the next panel slice).
template <int R>
inline void tile(const float* x, int64_t ldx, const float* panel, int64_t kc, float* y, int64_t ldy,
                 const float* bias, bool first, const char* pf, int64_t pf_n) {
  // named accumulators, not an array: GCC kept an array of __m256 on the stack, a store per FMA
  __m256 c00, c01, c10, c11, c20, c21, c30, c31, c40, c41, c50, c51;
  if (first) {
    c00 = bias ? _mm256_loadu_ps(bias) : _mm256_setzero_ps();
    c01 = bias ? _mm256_loadu_ps(bias + 8) : _mm256_setzero_ps();
    c10 = c20 = c30 = c40 = c50 = c00;
    c11 = c21 = c31 = c41 = c51 = c01;
  } else {
#define PS_LOAD(m)                                \
  if constexpr (R > m) {                          \
    c##m##0 = _mm256_loadu_ps(y + m * ldy);       \
    c##m##1 = _mm256_loadu_ps(y + m * ldy + 8);   \
  }
    c10 = c11 = c20 = c21 = c30 = c31 = c40 = c41 = c50 = c51 = _mm256_setzero_ps();
    PS_LOAD(0) PS_LOAD(1) PS_LOAD(2) PS_LOAD(3) PS_LOAD(4) PS_LOAD(5)
#undef PS_LOAD
  }
#define PS_FMA(m)                                            \
  if constexpr (R > m) {                                     \
    const __m256 a = _mm256_broadcast_ss(x + m * ldx + k);   \
    c##m##0 = _mm256_fmadd_ps(a, w0, c##m##0);               \
    c##m##1 = _mm256_fmadd_ps(a, w1, c##m##1);               \
  }
#define PS_STEP                                                                                    \
  {                                                                                                \
    const __m256 w0 = _mm256_loadu_ps(panel + NR * k), w1 = _mm256_loadu_ps(panel + NR * k + 8);   \
    PS_FMA(0) PS_FMA(1) PS_FMA(2) PS_FMA(3) PS_FMA(4) PS_FMA(5)                                    \
  }
  int64_t k = 0;
  for (const int64_t kp = std::min(pf_n, kc); k < kp; ++k) {
    _mm_prefetch(pf + 64 * k, _MM_HINT_T0);
    PS_STEP
  }
  for (; k < kc; ++k) PS_STEP
#undef PS_STEP
#undef PS_FMA
#define PS_STORE(m)                               \
  if constexpr (R > m) {                          \
    _mm256_storeu_ps(y + m * ldy, c##m##0);       \
    _mm256_storeu_ps(y + m * ldy + 8, c##m##1);   \
  }
  PS_STORE(0) PS_STORE(1) PS_STORE(2) PS_STORE(3) PS_STORE(4) PS_STORE(5)
#undef PS_STORE
}

// A partial last panel reads its tile from y only through `cols` columns: widen it through a buffer.
inline void tile_rows(int64_t rows, const float* x, int64_t ldx, const float* panel, int64_t kc, float* y,
                      int64_t ldy, const float* bias, bool first, int64_t cols, const char* pf = nullptr,
                      int64_t pf_n = 0) {
  alignas(32) float scratch[MR * NR];
  float* out = y;
  int64_t ld = ldy;
  if (cols < NR) {  // accumulate in a full-width scratch tile
    out = scratch;
    ld = NR;
    for (int64_t m = 0; m < rows; ++m) {
      std::memset(scratch + m * NR, 0, sizeof(float) * NR);
      if (!first) std::memcpy(scratch + m * NR, y + m * ldy, cols * sizeof(float));
    }
  }
  alignas(32) float padded_bias[NR] = {};
  const float* b = bias;
  if (bias && cols < NR) {
    std::memcpy(padded_bias, bias, cols * sizeof(float));
    b = padded_bias;
  }
  switch (rows) {
    case 1: tile<1>(x, ldx, panel, kc, out, ld, b, first, pf, pf_n); break;
    case 2: tile<2>(x, ldx, panel, kc, out, ld, b, first, pf, pf_n); break;
    case 3: tile<3>(x, ldx, panel, kc, out, ld, b, first, pf, pf_n); break;
    case 4: tile<4>(x, ldx, panel, kc, out, ld, b, first, pf, pf_n); break;
    case 5: tile<5>(x, ldx, panel, kc, out, ld, b, first, pf, pf_n); break;
    default: tile<6>(x, ldx, panel, kc, out, ld, b, first, pf, pf_n); break;
  }
  if (cols < NR)
    for (int64_t m = 0; m < rows; ++m) std::memcpy(y + m * ldy, scratch + m * NR, cols * sizeof(float));
}
#endif


#if defined(PAGEDSERVE_GEMM_BF16)
constexpr int64_t NB = 32;  // output features per bf16 panel (2 zmm of fp32 sums)
constexpr int64_t MB = 12;  // rows per tile: 24 accumulators + 2 panel vectors + 1 broadcast

// y[m, 0:cols] = round_bf16(bias + sum over i < k2 of x[m, 2i:2i+2] . panel[i, :, 0:2]) for m < R.
// x rows hold an even number of bf16 (ldx, k2 pairs); `bias` fp32 [cols] or null.
template <int R>
inline void tile_bf16(const at::BFloat16* x, int64_t ldx, const at::BFloat16* panel, int64_t k2, at::BFloat16* y,
                      int64_t ldy, const float* bias, int64_t cols) {
  const __mmask16 m0 = cols >= 16 ? 0xffff : static_cast<__mmask16>((1u << cols) - 1);
  const __mmask16 m1 = cols >= 32 ? 0xffff : cols <= 16 ? 0 : static_cast<__mmask16>((1u << (cols - 16)) - 1);
  const __m512 b0 = bias ? _mm512_maskz_loadu_ps(m0, bias) : _mm512_setzero_ps();
  const __m512 b1 = bias ? _mm512_maskz_loadu_ps(m1, bias + 16) : _mm512_setzero_ps();
  __m512 c00 = b0, c01 = b1, c10 = b0, c11 = b1, c20 = b0, c21 = b1, c30 = b0, c31 = b1, c40 = b0, c41 = b1,
         c50 = b0, c51 = b1, c60 = b0, c61 = b1, c70 = b0, c71 = b1, c80 = b0, c81 = b1, c90 = b0, c91 = b1,
         ca0 = b0, ca1 = b1, cb0 = b0, cb1 = b1;
  const int32_t* xp = reinterpret_cast<const int32_t*>(x);  // one int32 = the bf16 pair (x[2i], x[2i+1])
  const int64_t ld2 = ldx / 2;
  for (int64_t i = 0; i < k2; ++i) {
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(panel + NB * 2 * i);
    const __m512bh w1 = (__m512bh)_mm512_loadu_si512(panel + NB * 2 * i + 32);
#define PS_DOT(m, r)                                                 \
  if constexpr (R > m) {                                             \
    const __m512bh a = (__m512bh)_mm512_set1_epi32(xp[m * ld2 + i]); \
    c##r##0 = _mm512_dpbf16_ps(c##r##0, a, w0);                      \
    c##r##1 = _mm512_dpbf16_ps(c##r##1, a, w1);                      \
  }
    PS_DOT(0, 0) PS_DOT(1, 1) PS_DOT(2, 2) PS_DOT(3, 3) PS_DOT(4, 4) PS_DOT(5, 5)
    PS_DOT(6, 6) PS_DOT(7, 7) PS_DOT(8, 8) PS_DOT(9, 9) PS_DOT(10, a) PS_DOT(11, b)
#undef PS_DOT
  }
#define PS_OUT(m, r)                                                                                  \
  if constexpr (R > m) {                                                                              \
    _mm256_mask_storeu_epi16(y + m * ldy, m0, (__m256i)_mm512_cvtneps_pbh(c##r##0));                  \
    if (m1) _mm256_mask_storeu_epi16(y + m * ldy + 16, m1, (__m256i)_mm512_cvtneps_pbh(c##r##1));     \
  }
  PS_OUT(0, 0) PS_OUT(1, 1) PS_OUT(2, 2) PS_OUT(3, 3) PS_OUT(4, 4) PS_OUT(5, 5)
  PS_OUT(6, 6) PS_OUT(7, 7) PS_OUT(8, 8) PS_OUT(9, 9) PS_OUT(10, a) PS_OUT(11, b)
#undef PS_OUT
}

using TileBf16 = void (*)(const at::BFloat16*, int64_t, const at::BFloat16*, int64_t, at::BFloat16*, int64_t,
                          const float*, int64_t);
constexpr TileBf16 kTilesBf16[MB + 1] = {nullptr,          tile_bf16<1>,  tile_bf16<2>, tile_bf16<3>, tile_bf16<4>,
                                         tile_bf16<5>,     tile_bf16<6>,  tile_bf16<7>, tile_bf16<8>, tile_bf16<9>,
                                         tile_bf16<10>,    tile_bf16<11>, tile_bf16<12>};

#endif

}  // namespace

bool gemm_available() {
#if defined(PAGEDSERVE_GEMM)
  return true;
#else
  return false;
#endif
}

bool gemm_bf16_available() {
#if defined(PAGEDSERVE_GEMM_BF16)
  return true;
#else
  return false;
#endif
}

namespace {

// W [N, K] bf16 -> packed [ceil(N / 32), ceil(K / 2), 32, 2] (the bf16 layout above).
at::Tensor pack_linear_bf16(const at::Tensor& weight) {
  const at::Tensor w = weight.contiguous();
  const int64_t N = w.size(0), K = w.size(1), panels = (N + 31) / 32, k2 = (K + 1) / 2;
  at::Tensor packed = at::zeros({panels, k2, 32, 2}, w.options());
  const at::BFloat16* src = w.data_ptr<at::BFloat16>();
  at::BFloat16* dst = packed.data_ptr<at::BFloat16>();
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p)
      for (int64_t j = 0; j < 32 && p * 32 + j < N; ++j)
        for (int64_t k = 0; k < K; ++k) dst[((p * k2 + k / 2) * 32 + j) * 2 + k % 2] = src[(p * 32 + j) * K + k];
  });
  return packed;
}

at::Tensor linear_packed_bf16(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                              int64_t N) {
  TORCH_CHECK(gemm_bf16_available(), "linear_packed: built without AVX512-BF16");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16, "linear_packed: a bf16 weight takes bf16 x");
  TORCH_CHECK(packed.dim() == 4 && packed.size(2) == 32 && packed.size(3) == 2 && packed.is_contiguous(),
              "linear_packed: bad packing");
  const int64_t k2 = packed.size(1), panels = packed.size(0), K = x.size(-1);
  TORCH_CHECK(K == 2 * k2 || K == 2 * k2 - 1, "linear_packed: x has ", K, " features, the weight ", 2 * k2);
  TORCH_CHECK(N > (panels - 1) * 32 && N <= panels * 32, "linear_packed: N does not match the packing");
  at::Tensor xc = x.reshape({-1, K}).contiguous();
  if (K % 2) xc = at::constant_pad_nd(xc, {0, 1});  // an odd K reads pairs: its last pair gets a zero
  const int64_t M = xc.size(0);
  at::Tensor bc;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == N, "linear_packed: bias must have N values");
    bc = bias->to(at::kFloat).contiguous();
  }
  std::vector<int64_t> out_shape(x.sizes().begin(), x.sizes().end());
  out_shape.back() = N;
  at::Tensor y = at::empty({M, N}, xc.options());
#if defined(PAGEDSERVE_GEMM_BF16)
  const at::BFloat16* xp = xc.data_ptr<at::BFloat16>();
  const at::BFloat16* wp = packed.data_ptr<at::BFloat16>();
  const float* bp = bc.defined() ? bc.data_ptr<float>() : nullptr;
  at::BFloat16* yp = y.data_ptr<at::BFloat16>();
  const int64_t ldx = 2 * k2;
  at::parallel_for(0, panels, 4, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const at::BFloat16* panel = wp + p * k2 * 64;
      const int64_t cols = std::min<int64_t>(32, N - p * 32);
      // rows in tiles of equal size (a small last tile computes slowly)
      const int64_t tiles = (M + MB - 1) / MB;
      for (int64_t t = 0, m = 0; t < tiles; ++t) {
        const int64_t rows = (M - m) / (tiles - t) + ((M - m) % (tiles - t) != 0);
        kTilesBf16[rows](xp + m * ldx, ldx, panel, k2, yp + m * N + p * 32, N, bp ? bp + p * 32 : nullptr, cols);
        m += rows;
      }
    }
  });
#endif
  return y.view(out_shape);
}

}  // namespace

// W [N, K] -> packed: fp32 [ceil(N / 16), K, 16], bf16 [ceil(N / 32), ceil(K / 2), 32, 2] (the layouts above).
at::Tensor pack_linear(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2, "pack_linear: a 2-D weight");
  if (weight.scalar_type() == at::kBFloat16) {
    TORCH_CHECK(gemm_bf16_available(), "pack_linear: built without AVX512-BF16");
    return pack_linear_bf16(weight);
  }
  TORCH_CHECK(weight.scalar_type() == at::kFloat, "pack_linear: a 2-D fp32 or bf16 weight");
  const at::Tensor w = weight.contiguous();
  const int64_t N = w.size(0), K = w.size(1), panels = (N + NR - 1) / NR;
  at::Tensor packed = at::zeros({panels, K, NR}, w.options());
  const float* src = w.data_ptr<float>();
  float* dst = packed.data_ptr<float>();
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p)
      for (int64_t j = 0; j < NR && p * NR + j < N; ++j)
        for (int64_t k = 0; k < K; ++k) dst[(p * K + k) * NR + j] = src[(p * NR + j) * K + k];
  });
  return packed;
}

// y [M, N] = x [M, K] W^T + bias, W given packed (pack_linear) with its N.
at::Tensor linear_packed(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                         int64_t N) {
  if (packed.scalar_type() == at::kBFloat16) return linear_packed_bf16(x, packed, bias, N);
  TORCH_CHECK(gemm_available(), "linear_packed: built without AVX2/FMA");
  TORCH_CHECK(x.scalar_type() == at::kFloat && packed.scalar_type() == at::kFloat, "linear_packed: fp32 only");
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == NR && packed.is_contiguous(), "linear_packed: bad packing");
  const int64_t K = packed.size(1), panels = packed.size(0);
  TORCH_CHECK(x.size(-1) == K, "linear_packed: x has ", x.size(-1), " features, the weight ", K);
  TORCH_CHECK(N > (panels - 1) * NR && N <= panels * NR, "linear_packed: N does not match the packing");
  const at::Tensor xc = x.reshape({-1, K}).contiguous();
  const int64_t M = xc.size(0);
  const float* bp = nullptr;
  at::Tensor bc;
  if (bias.has_value() && bias->defined()) {
    bc = bias->contiguous();
    TORCH_CHECK(bc.scalar_type() == at::kFloat && bc.numel() == N, "linear_packed: bias must be fp32 [N]");
    bp = bc.data_ptr<float>();
  }
  std::vector<int64_t> out_shape(x.sizes().begin(), x.sizes().end());
  out_shape.back() = N;
  at::Tensor y = at::empty({M, N}, xc.options());
#if defined(PAGEDSERVE_GEMM)
  const float* xp = xc.data_ptr<float>();
  const float* wp = packed.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  if (M == 0) return y.view(out_shape);
  // threads split the panels (output features)
  if (M <= MC) {
    // few rows (decode): panel by panel, each in even passes of <= KD k. Row tiles of equal size
    // unless that makes them shorter than 5 rows (8 rows ran 1.2x slower as 4 + 4 than as 6 + 2).
    const int64_t passes = (K + KD - 1) / KD, tiles = (M + MR - 1) / MR;
    const bool equal = M / tiles >= 5;
    pagedserve_pool::decode_for(panels, 4, 2, [&](int64_t p0, int64_t p1) {
      const char* end = reinterpret_cast<const char*>(wp + p1 * K * NR);  // this thread's last panel ends
      for (int64_t p = p0; p < p1; ++p) {
        const int64_t cols = std::min(NR, N - p * NR);
        for (int64_t s = 0, k0 = 0; s < passes; ++s) {
          const int64_t kc = (K - k0 + passes - s - 1) / (passes - s);
          const float* panel = wp + (p * K + k0) * NR;
          // the next slice follows in memory (this panel's next pass or the next panel's first):
          // its kc lines of 64 B are prefetched in shares spread over this slice's tiles
          const char* next = reinterpret_cast<const char*>(panel + kc * NR);
          int64_t lines = M < PF_MIN_ROWS ? 0 : std::min<int64_t>(kc, std::max<int64_t>(0, (end - next) / 64));
          for (int64_t t = 0, m = 0; t < tiles; ++t) {
            const int64_t rows = equal ? (M - m + tiles - t - 1) / (tiles - t) : std::min(MR, M - m);
            const int64_t share = (lines + tiles - t - 1) / (tiles - t);
            tile_rows(rows, xp + m * K + k0, K, panel, kc, yp + m * N + p * NR, N, bp ? bp + p * NR : nullptr,
                      k0 == 0, cols, next, share);
            next += 64 * share;
            lines -= share;
            m += rows;
          }
          k0 += kc;
        }
      }
    });
    return y.view(out_shape);
  }
  // more rows (prefill): blocks of MC rows x KC k, each panel slice reused over a row block
  at::parallel_for(0, panels, 4, [&](int64_t p0, int64_t p1) {
    for (int64_t m0 = 0; m0 < M; m0 += MC) {
      const int64_t mc = std::min(MC, M - m0);
      for (int64_t k0 = 0; k0 < K; k0 += KC) {
        const int64_t kc = std::min(KC, K - k0);
        for (int64_t p = p0; p < p1; ++p) {
          const float* panel = wp + (p * K + k0) * NR;
          const int64_t cols = std::min(NR, N - p * NR);
          for (int64_t m = m0; m < m0 + mc; m += MR) {
            const int64_t rows = std::min(MR, m0 + mc - m);
            tile_rows(rows, xp + m * K + k0, K, panel, kc, yp + m * N + p * NR, N, bp ? bp + p * NR : nullptr,
                      k0 == 0, cols);
          }
        }
      }
    }
  });
#endif
  return y.view(out_shape);
}

// Linear layers whose fp32 weights are exact GGUF block values (a dequantized Q4_1 or Q8_0 file, as
// the default model is), kept in those blocks instead: 5-6x fewer bytes streamed per step, the same
// fp32 weights and sums. Each call dequantizes a panel slice (up to KC k x 16 features) into a
// buffer in L1 and runs the fp32 tiles above over it, so every row count gets the same kernel.
//
// Block of 32 k of one feature, in panels of 16 features (features past N are zero), for panel p
// and block b (k = 32 b + i, feature 16 p + j):
//   Q4_1: q [panels, K / 32, 32, 8] uint8: byte (p, b, i, j % 8) holds q of feature j < 8 in its low
//         nibble, of feature j + 8 in its high one; scales [panels, K / 32, 2, 16] fp32 (d, m):
//         w = d q + m. d has an fp16's 11 bits, so d q (q < 16) is exact and the FMA rounds once,
//         as gguf's fp32 dequantization does (d q exact, then + m rounded).
//   Q8_0: q [panels, K / 32, 32, 16] int8; scales [panels, K / 32, 1, 16] fp32 (d): w = d q (exact).
namespace {

constexpr int64_t QB = 32;  // k per GGUF block

#if defined(PAGEDSERVE_GEMM)
// out[(b - b0) * 32 + i, 0:16] = the weights of blocks b0 <= b < b1 of one panel
inline void dequant_q4_1(const uint8_t* q, const float* scales, int64_t b0, int64_t b1, float* out) {
  const __m256i low = _mm256_set1_epi32(0xf);
  for (int64_t b = b0; b < b1; ++b) {
    const float* s = scales + b * 32;
    const __m256 d0 = _mm256_loadu_ps(s), d1 = _mm256_loadu_ps(s + 8);
    const __m256 m0 = _mm256_loadu_ps(s + 16), m1 = _mm256_loadu_ps(s + 24);
    const uint8_t* qb = q + b * QB * 8;
    for (int64_t i = 0; i < QB; ++i, out += NR) {
      const __m256i bytes = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(qb + 8 * i)));
      const __m256 lo = _mm256_cvtepi32_ps(_mm256_and_si256(bytes, low));
      const __m256 hi = _mm256_cvtepi32_ps(_mm256_srli_epi32(bytes, 4));
      _mm256_store_ps(out, _mm256_fmadd_ps(lo, d0, m0));
      _mm256_store_ps(out + 8, _mm256_fmadd_ps(hi, d1, m1));
    }
  }
}

inline void dequant_q8_0(const int8_t* q, const float* scales, int64_t b0, int64_t b1, float* out) {
  for (int64_t b = b0; b < b1; ++b) {
    const __m256 d0 = _mm256_loadu_ps(scales + b * 16), d1 = _mm256_loadu_ps(scales + b * 16 + 8);
    const int8_t* qb = q + b * QB * 16;
    for (int64_t i = 0; i < QB; ++i, out += NR) {
      const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qb + 16 * i));
      const __m256 v0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
      const __m256 v1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(bytes, bytes)));
      _mm256_store_ps(out, _mm256_mul_ps(v0, d0));
      _mm256_store_ps(out + 8, _mm256_mul_ps(v1, d1));
    }
  }
}

// Up to 3 rows (decode at concurrency 1-3): the weights dequantized in registers, straight into
// the FMAs (no slice buffer), over a panel's whole K: y[m, 0:cols] = bias + sum_k x[m, k] w[k, :]
// in the order the tiles add them (results equal the buffered path's bit for bit).
// 2 R sums + 4 scale vectors + 2 weight vectors + temporaries fit the 16 ymm.
template <int R, bool Q8>
inline void panel_rows_fused(const float* x, int64_t ldx, const uint8_t* q, const float* scales, int64_t blocks,
                             float* y, int64_t ldy, const float* bias, int64_t cols) {
  // from the bias, as the tiles start: each row's sum is the same at every row count
  alignas(32) float b16[NR] = {};
  if (bias) std::memcpy(b16, bias, cols * sizeof(float));
  __m256 c00 = _mm256_load_ps(b16), c01 = _mm256_load_ps(b16 + 8), c10 = c00, c11 = c01, c20 = c00, c21 = c01;
  const __m256i low = _mm256_set1_epi32(0xf);
  for (int64_t b = 0; b < blocks; ++b) {
    const float* s = scales + b * (Q8 ? 16 : 32);
    const __m256 d0 = _mm256_loadu_ps(s), d1 = _mm256_loadu_ps(s + 8);
    const __m256 m0 = Q8 ? _mm256_setzero_ps() : _mm256_loadu_ps(s + 16);
    const __m256 m1 = Q8 ? _mm256_setzero_ps() : _mm256_loadu_ps(s + 24);
    const uint8_t* qb = q + b * QB * (Q8 ? 16 : 8);
    const float* xb = x + b * QB;
    for (int64_t i = 0; i < QB; ++i) {
      __m256 w0, w1;
      if constexpr (Q8) {
        const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qb + 16 * i));
        w0 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes)), d0);
        w1 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(bytes, bytes))), d1);
      } else {
        const __m256i bytes =
            _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(qb + 8 * i)));
        w0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(bytes, low)), d0, m0);
        w1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(bytes, 4)), d1, m1);
      }
#define PS_FMA(m)                                            \
  if constexpr (R > m) {                                     \
    const __m256 a = _mm256_broadcast_ss(xb + m * ldx + i);  \
    c##m##0 = _mm256_fmadd_ps(a, w0, c##m##0);               \
    c##m##1 = _mm256_fmadd_ps(a, w1, c##m##1);               \
  }
      PS_FMA(0) PS_FMA(1) PS_FMA(2)
#undef PS_FMA
    }
  }
  alignas(32) float out[3 * NR];
  _mm256_store_ps(out, c00), _mm256_store_ps(out + 8, c01);
  _mm256_store_ps(out + 16, c10), _mm256_store_ps(out + 24, c11);
  _mm256_store_ps(out + 32, c20), _mm256_store_ps(out + 40, c21);
  for (int64_t m = 0; m < R; ++m)
    std::memcpy(y + m * ldy, out + m * NR, cols * sizeof(float));
}
#endif

}  // namespace

// y [M, N] = x [M, K] W^T + bias, W in GGUF blocks (the layouts above; `q8`: Q8_0, else Q4_1).
at::Tensor linear_blocks(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scales,
                         const c10::optional<at::Tensor>& bias, int64_t N, bool q8) {
  TORCH_CHECK(gemm_available(), "linear_blocks: built without AVX2/FMA");
  TORCH_CHECK(x.scalar_type() == at::kFloat, "linear_blocks: fp32 x");
  TORCH_CHECK(q.dim() == 4 && q.size(2) == QB && q.size(3) == (q8 ? 16 : 8) && q.is_contiguous() &&
                  q.scalar_type() == (q8 ? at::kChar : at::kByte),
              "linear_blocks: bad block layout");
  const int64_t panels = q.size(0), blocks = q.size(1), K = blocks * QB;
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.dim() == 4 &&
                  scales.size(0) == panels && scales.size(1) == blocks && scales.size(2) == (q8 ? 1 : 2) &&
                  scales.size(3) == NR,
              "linear_blocks: bad scales");
  TORCH_CHECK(x.size(-1) == K, "linear_blocks: x has ", x.size(-1), " features, the weight ", K);
  TORCH_CHECK(N > (panels - 1) * NR && N <= panels * NR, "linear_blocks: N does not match the panels");
  const at::Tensor xc = x.reshape({-1, K}).contiguous();
  const int64_t M = xc.size(0);
  at::Tensor bc;
  if (bias.has_value() && bias->defined()) {
    bc = bias->contiguous();
    TORCH_CHECK(bc.scalar_type() == at::kFloat && bc.numel() == N, "linear_blocks: bias must be fp32 [N]");
  }
  std::vector<int64_t> out_shape(x.sizes().begin(), x.sizes().end());
  out_shape.back() = N;
  at::Tensor y = at::empty({M, N}, xc.options());
#if defined(PAGEDSERVE_GEMM)
  if (M == 0) return y.view(out_shape);
  const float* xp = xc.data_ptr<float>();
  const float* bp = bc.defined() ? bc.data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  const uint8_t* qp = static_cast<const uint8_t*>(q.data_ptr());
  const float* sp = scales.data_ptr<float>();
  const int64_t panel_q = blocks * QB * (q8 ? 16 : 8), panel_s = blocks * scales.size(2) * NR;
  auto dequant = [&](int64_t p, int64_t b0, int64_t b1, float* out) {
    if (q8)
      dequant_q8_0(reinterpret_cast<const int8_t*>(qp + p * panel_q), sp + p * panel_s, b0, b1, out);
    else
      dequant_q4_1(qp + p * panel_q, sp + p * panel_s, b0, b1, out);
  };
  const int64_t tiles = (M + MR - 1) / MR;
  // a slice of blocks b0 <= b < b0 + nb of panel p, through all rows m0 <= m < m0 + mc
  auto slice_rows = [&](float* slice, int64_t p, int64_t b0, int64_t nb, int64_t m0, int64_t mc, bool equal) {
    dequant(p, b0, b0 + nb, slice);
    const int64_t cols = std::min(NR, N - p * NR), k0 = b0 * QB;
    for (int64_t t = 0, m = m0; m < m0 + mc; ++t) {
      const int64_t rows = equal ? (M - m + tiles - t - 1) / (tiles - t) : std::min(MR, m0 + mc - m);
      tile_rows(rows, xp + m * K + k0, K, slice, nb * QB, yp + m * N + p * NR, N, bp ? bp + p * NR : nullptr,
                k0 == 0, cols);
      m += rows;
    }
  };
  if (M <= 3) {  // concurrency 1-3: dequantized in registers
    pagedserve_pool::decode_for(panels, 4, 8, [&](int64_t p0, int64_t p1) {
      for (int64_t p = p0; p < p1; ++p) {
        const uint8_t* qp_ = qp + p * panel_q;
        const float* sp_ = sp + p * panel_s;
        const float* b = bp ? bp + p * NR : nullptr;
        const int64_t cols = std::min(NR, N - p * NR);
        float* yp_ = yp + p * NR;
        if (q8) {
          if (M == 1) panel_rows_fused<1, true>(xp, K, qp_, sp_, blocks, yp_, N, b, cols);
          else if (M == 2) panel_rows_fused<2, true>(xp, K, qp_, sp_, blocks, yp_, N, b, cols);
          else panel_rows_fused<3, true>(xp, K, qp_, sp_, blocks, yp_, N, b, cols);
        } else {
          if (M == 1) panel_rows_fused<1, false>(xp, K, qp_, sp_, blocks, yp_, N, b, cols);
          else if (M == 2) panel_rows_fused<2, false>(xp, K, qp_, sp_, blocks, yp_, N, b, cols);
          else panel_rows_fused<3, false>(xp, K, qp_, sp_, blocks, yp_, N, b, cols);
        }
      }
    });
    return y.view(out_shape);
  }
  if (M <= MC) {
    // few rows (decode): panel by panel (the blocks stream in order), in even passes of <= KD k;
    // row tiles as linear_packed's
    const int64_t passes = (blocks + KD / QB - 1) / (KD / QB);
    const bool equal = M / tiles >= 5;
    pagedserve_pool::decode_for(panels, 4, 2, [&](int64_t p0, int64_t p1) {
      alignas(64) float slice[KD * NR];
      for (int64_t p = p0; p < p1; ++p)
        for (int64_t s = 0, b0 = 0; s < passes; ++s) {
          const int64_t nb = (blocks - b0 + passes - s - 1) / (passes - s);
          slice_rows(slice, p, b0, nb, 0, M, equal);
          b0 += nb;
        }
    });
    return y.view(out_shape);
  }
  // more rows (prefill): blocks of MC rows x KC k, each panel slice dequantized once per row block
  pagedserve_pool::decode_for(panels, 4, 4, [&](int64_t p0, int64_t p1) {
    alignas(64) float slice[KC * NR];
    for (int64_t m0 = 0; m0 < M; m0 += MC)
      for (int64_t b0 = 0; b0 < blocks; b0 += KC / QB)
        for (int64_t p = p0; p < p1; ++p)
          slice_rows(slice, p, b0, std::min(KC / QB, blocks - b0), m0, std::min(MC, M - m0), false);
  });
#endif
  return y.view(out_shape);
}

// The decode pool's helper threads (cpu_pool.h): `helpers` beside the caller's, spinning `spin_us`
// after each region before they sleep; 0 helpers: decode regions on torch's threads.
void set_decode_pool(int64_t helpers, int64_t spin_us) {
  pagedserve_pool::Pool::get().configure(static_cast<int>(helpers), static_cast<int>(spin_us));
}

int64_t decode_pool_helpers() { return pagedserve_pool::Pool::get().helpers(); }
