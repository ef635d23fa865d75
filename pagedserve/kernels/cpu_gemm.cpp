// fp32 linear layers (y = x W^T + b) on AVX2 + FMA CPUs, with the weight packed once into panels.
//
// Why: on an AVX2-only CPU (AMD EPYC Zen 3, one core) torch's fp32 paths stream the weights of a
// decode step of one row at 3-7 GB/s (oneDNN's kernels on prepacked weights, MKL for F.linear),
// where the core reads 10 GB/s. The kernel below keeps a 6 x 16 tile of y in 12 ymm registers and
// streams a panel of 16 output features (K x 16 floats, laid out in the order the kernel reads
// them) once from memory per call, reusing it from cache for every group of 6 rows. It wins at
// few rows (layers.GEMM_MAX_ROWS says where); past that oneDNN's blocking of rows wins.
//
// Layout: packed [ceil(N / 16), K, 16]: panel p holds W[16 p + j, k] at (p, k, j); the features
// past N are zero. Sums over k run in order with FMA (results differ from MKL's by rounding).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define PAGEDSERVE_GEMM 1
#endif

namespace {

constexpr int64_t NR = 16;   // output features per panel (2 ymm)
constexpr int64_t MR = 6;    // rows per tile: 12 accumulators + 2 panel vectors + 1 broadcast
constexpr int64_t KC = 512;  // k per pass: a panel slice of 32 KB stays in L1/L2 across a row block
constexpr int64_t MC = 96;   // rows per block: 96 x KC floats of x (192 KB) stay in L2

#if defined(PAGEDSERVE_GEMM)
// y[m, 0:16] (+)= sum over k < kc of x[m, k] * panel[k, 0:16] for m < R (R <= MR). `first`: the
// tile starts from the bias (or zero) instead of y.
template <int R>
inline void tile(const float* x, int64_t ldx, const float* panel, int64_t kc, float* y, int64_t ldy,
                 const float* bias, bool first) {
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
  const float* x0 = x;
  for (int64_t k = 0; k < kc; ++k) {
    const __m256 w0 = _mm256_loadu_ps(panel + NR * k), w1 = _mm256_loadu_ps(panel + NR * k + 8);
#define PS_FMA(m)                                             \
  if constexpr (R > m) {                                      \
    const __m256 a = _mm256_broadcast_ss(x0 + m * ldx + k);   \
    c##m##0 = _mm256_fmadd_ps(a, w0, c##m##0);                \
    c##m##1 = _mm256_fmadd_ps(a, w1, c##m##1);                \
  }
    PS_FMA(0) PS_FMA(1) PS_FMA(2) PS_FMA(3) PS_FMA(4) PS_FMA(5)
#undef PS_FMA
  }
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
                      int64_t ldy, const float* bias, bool first, int64_t cols) {
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
    case 1: tile<1>(x, ldx, panel, kc, out, ld, b, first); break;
    case 2: tile<2>(x, ldx, panel, kc, out, ld, b, first); break;
    case 3: tile<3>(x, ldx, panel, kc, out, ld, b, first); break;
    case 4: tile<4>(x, ldx, panel, kc, out, ld, b, first); break;
    case 5: tile<5>(x, ldx, panel, kc, out, ld, b, first); break;
    default: tile<6>(x, ldx, panel, kc, out, ld, b, first); break;
  }
  if (cols < NR)
    for (int64_t m = 0; m < rows; ++m) std::memcpy(y + m * ldy, scratch + m * NR, cols * sizeof(float));
}
#endif

}  // namespace

bool gemm_available() {
#if defined(PAGEDSERVE_GEMM)
  return true;
#else
  return false;
#endif
}

// W [N, K] fp32 -> packed [ceil(N / 16), K, 16] (the layout above).
at::Tensor pack_linear(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat, "pack_linear: a 2-D fp32 weight");
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
  // threads split the panels (output features); each thread runs its panels over every row block
  at::parallel_for(0, panels, 4, [&](int64_t p0, int64_t p1) {
    for (int64_t m0 = 0; m0 < M; m0 += MC) {
      const int64_t mc = std::min(MC, M - m0);
      // few rows (decode): each panel whole, the packed weight read in one sequential stream
      const int64_t kc_block = M <= MC ? K : KC;
      for (int64_t k0 = 0; k0 < K; k0 += kc_block) {
        const int64_t kc = std::min(kc_block, K - k0);
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
