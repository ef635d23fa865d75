// Prefill attention in bf16 on CPUs with AVX512-BF16: one sequence's chunk of queries against its
// paged KV, causal (and windowed), in one pass over the keys with an online softmax.
//
// Why: torch's CPU SDPA (flash) ran a 256-token prefill of SmolLM2 (9 query heads of 64, 3 KV
// heads) at ~38 GFLOP/s in bf16 on a Zen 5 core, 2 ms a layer and a third of the step, where the
// core's vdpbf16ps reaches ~400 GFLOP/s in the linears.
//
// Shape of the work: queries sit in the 16 lanes of a zmm (a tile of 16 positions of one query
// head), so a key's score for the whole tile is one chain of vdpbf16ps over the head dim (the key's
// pairs of features broadcast, the tile's queries packed [D / 2][16][2]); sixteen keys (a group)
// run as sixteen independent chains. The softmax state (max, sum) is per lane, and P.V is again
// vdpbf16ps: the probabilities of two keys interleaved as bf16 pairs per lane against the two keys'
// values of one feature, broadcast from V transposed to [D][keys]. The output is kept transposed,
// [D][16] fp32, scaled by the running correction once per group.
//
// The sequence's K rows are first gathered from their blocks into a contiguous [keys][D] copy and
// V transposed into [D][keys] (both zero past the last key), once per KV head per call. Scores
// and sums are fp32; probabilities are rounded to bf16 for P.V, as flash attention does in bf16.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu_kernels.h"
#include "cpu_pool.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#include "cpu_amx.h"
#include "cpu_vec.h"
#define PAGEDSERVE_PREFILL_BF16 1
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define PAGEDSERVE_PREFILL_AMX 1
#endif
#endif


namespace {

#if defined(PAGEDSERVE_PREFILL_BF16)
constexpr int64_t G = 16;           // keys per group, queries per tile
constexpr float kMasked = -1e30f;   // a finite "minus infinity" (the build uses -ffast-math)

struct Prefill {
  const at::BFloat16* q;  // [T, Hq, D]
  at::BFloat16* out;      // [T, Hq, D]
  int64_t T, Hq, Hkv, D, first, seq_len, kbase, window;
  float scale;
};

// 16 bf16 (bits in a ymm) as fp32.
inline __m512 widen(__m256i bf16) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bf16), 16));
}

// The scores of 16 keys (rows of kc, each D bf16) against a tile of queries (qp [D / 2][16] pairs):
// s[k] lane q = <K_k, Q_q>.
inline void scores16(const at::BFloat16* kc, int64_t D, const __m512bh* qp, __m512* s) {
  __m512 s0 = _mm512_setzero_ps(), s1 = s0, s2 = s0, s3 = s0, s4 = s0, s5 = s0, s6 = s0, s7 = s0, s8 = s0,
         s9 = s0, s10 = s0, s11 = s0, s12 = s0, s13 = s0, s14 = s0, s15 = s0;
  const int32_t* k32 = reinterpret_cast<const int32_t*>(kc);
  const int64_t ld = D / 2;
  for (int64_t d2 = 0; d2 < D / 2; ++d2) {
    const __m512bh qv = qp[d2];
#define PS_S(k) s##k = _mm512_dpbf16_ps(s##k, (__m512bh)_mm512_set1_epi32(k32[k * ld + d2]), qv);
    PS_S(0) PS_S(1) PS_S(2) PS_S(3) PS_S(4) PS_S(5) PS_S(6) PS_S(7)
    PS_S(8) PS_S(9) PS_S(10) PS_S(11) PS_S(12) PS_S(13) PS_S(14) PS_S(15)
#undef PS_S
  }
  s[0] = s0; s[1] = s1; s[2] = s2; s[3] = s3; s[4] = s4; s[5] = s5; s[6] = s6; s[7] = s7;
  s[8] = s8; s[9] = s9; s[10] = s10; s[11] = s11; s[12] = s12; s[13] = s13; s[14] = s14; s[15] = s15;
}

// ot[d] (lane q) = alpha * ot[d] + sum over the group's 16 keys of p_k[q] V[k, d], with the
// probabilities as 8 interleaved bf16 pairs (pp) and vt the group's first column of V^T [D][ldv].
inline void pv16(float* ot, int64_t D, __m512 alpha, const __m512bh* pp, const at::BFloat16* vt, int64_t ldv) {
  const __m512bh p0 = pp[0], p1 = pp[1], p2 = pp[2], p3 = pp[3], p4 = pp[4], p5 = pp[5], p6 = pp[6], p7 = pp[7];
  for (int64_t d = 0; d < D; ++d) {
    const int32_t* v32 = reinterpret_cast<const int32_t*>(vt + d * ldv);
    __m512 o = _mm512_mul_ps(_mm512_loadu_ps(ot + d * G), alpha);
    // two chains, summed at the end: the dot products of one feature are otherwise serial
    __m512 o2 = _mm512_setzero_ps();
    o = _mm512_dpbf16_ps(o, p0, (__m512bh)_mm512_set1_epi32(v32[0]));
    o2 = _mm512_dpbf16_ps(o2, p1, (__m512bh)_mm512_set1_epi32(v32[1]));
    o = _mm512_dpbf16_ps(o, p2, (__m512bh)_mm512_set1_epi32(v32[2]));
    o2 = _mm512_dpbf16_ps(o2, p3, (__m512bh)_mm512_set1_epi32(v32[3]));
    o = _mm512_dpbf16_ps(o, p4, (__m512bh)_mm512_set1_epi32(v32[4]));
    o2 = _mm512_dpbf16_ps(o2, p5, (__m512bh)_mm512_set1_epi32(v32[5]));
    o = _mm512_dpbf16_ps(o, p6, (__m512bh)_mm512_set1_epi32(v32[6]));
    o2 = _mm512_dpbf16_ps(o2, p7, (__m512bh)_mm512_set1_epi32(v32[7]));
    _mm512_storeu_ps(ot + d * G, _mm512_add_ps(o, o2));
  }
}

// The tile's queries as bf16 pairs: qp[d2] lane q = (Q[t0 + q, 2 d2], Q[t0 + q, 2 d2 + 1]), zero
// for lanes q >= nq. Also AMX's B operand for Q^T: rows d2, 16 queries of one pair each.
inline void query_pairs(const Prefill& a, int64_t hq, int64_t t0, int64_t nq, __m512bh* qp) {
  alignas(64) int32_t lanes[G];
  for (int64_t d2 = 0; d2 < a.D / 2; ++d2) {
    for (int64_t q = 0; q < G; ++q)
      lanes[q] = q < nq ? reinterpret_cast<const int32_t*>(a.q + ((t0 + q) * a.Hq + hq) * a.D)[d2] : 0;
    qp[d2] = (__m512bh)_mm512_load_si512(lanes);
  }
}

// Which of the 16 lanes (queries at positions pos) see key j: causal, before seq_len, in the window.
inline __mmask16 visible(const Prefill& a, __m512i pos, int64_t j, __mmask16 live) {
  if (j >= a.seq_len) return 0;
  __mmask16 v = _mm512_cmp_epi32_mask(pos, _mm512_set1_epi32(static_cast<int32_t>(j)), _MM_CMPINT_NLT);  // pos >= j
  if (a.window > 0)  // j > pos - window, i.e. pos < j + window
    v &= _mm512_cmp_epi32_mask(pos, _mm512_set1_epi32(static_cast<int32_t>(j + a.window)), _MM_CMPINT_LT);
  return v & live;
}

// c[j] = column j of the 16 x 16 fp32 rows r (r is overwritten)
inline void transpose16(__m512* r, __m512* c) {
  for (int i = 0; i < 16; i += 2) {  // per 128-bit lane: a0 b0 a1 b1, a2 b2 a3 b3
    const __m512 lo = _mm512_unpacklo_ps(r[i], r[i + 1]), hi = _mm512_unpackhi_ps(r[i], r[i + 1]);
    r[i] = lo, r[i + 1] = hi;
  }
  __m512 u[16];  // u[4 g + j], 128-bit lane L: column 4 L + j of rows 4 g .. 4 g + 3
  for (int i = 0; i < 16; i += 4) {
    u[i] = _mm512_shuffle_ps(r[i], r[i + 2], _MM_SHUFFLE(1, 0, 1, 0));
    u[i + 1] = _mm512_shuffle_ps(r[i], r[i + 2], _MM_SHUFFLE(3, 2, 3, 2));
    u[i + 2] = _mm512_shuffle_ps(r[i + 1], r[i + 3], _MM_SHUFFLE(1, 0, 1, 0));
    u[i + 3] = _mm512_shuffle_ps(r[i + 1], r[i + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int j = 0; j < 4; ++j) {  // lane L of u[j], u[4 + j], u[8 + j], u[12 + j] is column 4 L + j
    const __m512 x0 = _mm512_shuffle_f32x4(u[j], u[4 + j], 0x88), x1 = _mm512_shuffle_f32x4(u[j], u[4 + j], 0xDD);
    const __m512 y0 = _mm512_shuffle_f32x4(u[8 + j], u[12 + j], 0x88);
    const __m512 y1 = _mm512_shuffle_f32x4(u[8 + j], u[12 + j], 0xDD);
    c[j] = _mm512_shuffle_f32x4(x0, y0, 0x88);
    c[4 + j] = _mm512_shuffle_f32x4(x1, y1, 0x88);
    c[8 + j] = _mm512_shuffle_f32x4(x0, y0, 0xDD);
    c[12 + j] = _mm512_shuffle_f32x4(x1, y1, 0xDD);
  }
}

// out[t0 + q, hq, :] = O^T[:, q] / l[q] for the tile's live queries (ot 64-byte aligned), rounded
// to bf16 to nearest even: 16 features at a time through a 16 x 16 transpose
inline void store_tile(const Prefill& a, int64_t hq, int64_t t0, int64_t nq, const float* ot, __m512 l) {
  const __m512 inv = _mm512_div_ps(_mm512_set1_ps(1.0f), l);
  for (int64_t d0 = 0; d0 < a.D; d0 += G) {
    __m512 r[G], c[G];
    for (int64_t i = 0; i < G; ++i) r[i] = _mm512_mul_ps(_mm512_load_ps(ot + (d0 + i) * G), inv);
    transpose16(r, c);
    for (int64_t q = 0; q < nq; ++q)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(a.out + ((t0 + q) * a.Hq + hq) * a.D + d0),
                          (__m256i)_mm512_cvtneps_pbh(c[q]));
  }
}

// One tile: queries t0 .. t0 + 15 (those < T) of query head hq, against the keys gathered for its KV
// head (kc [L][D], vt [D][L], L = ldv keys from kbase on).
void prefill_tile(const Prefill& a, int64_t hq, int64_t t0, const at::BFloat16* kc, const at::BFloat16* vt,
                  int64_t ldv) {
  const int64_t D = a.D, nq = std::min(G, a.T - t0);
  std::vector<__m512bh> qp(D / 2);
  query_pairs(a, hq, t0, nq, qp.data());
  alignas(64) float ot[256 * G];  // O^T [D][16], D <= 256
  std::memset(ot, 0, sizeof(float) * D * G);
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i pos = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int32_t>(a.first + t0)), lane);
  const __mmask16 live = static_cast<__mmask16>(nq >= G ? 0xffff : (1u << nq) - 1);
  // interleave two keys' bf16 probabilities: out[2q] = p_a[q], out[2q + 1] = p_b[q]
  const __m512i interleave = pagedserve_amx::pair_interleave();
  __m512 m = _mm512_set1_ps(kMasked), l = _mm512_setzero_ps();
  const int64_t pos_lo = a.first + t0, pos_hi = a.first + t0 + nq - 1;  // the tile's positions
  const int64_t key_end = std::min(a.seq_len, pos_hi + 1);             // keys any query sees end here
  int64_t key_begin = a.kbase;
  if (a.window > 0) key_begin = std::max(key_begin, pos_lo - a.window + 1);
  // groups aligned to kbase (the gathered copies' columns)
  for (int64_t r0 = (key_begin - a.kbase) / G * G; a.kbase + r0 < key_end; r0 += G) {
    const int64_t j0 = a.kbase + r0;
    __m512 s[G];
    scores16(kc + r0 * D, D, qp.data(), s);
    // every lane sees every key of the group: no masks (the usual case away from the diagonal)
    const bool full = j0 + G - 1 <= pos_lo && j0 + G <= a.seq_len &&
                      (a.window <= 0 || j0 > pos_hi - a.window);
    __mmask16 vis[G];
    __m512 mx = _mm512_set1_ps(kMasked);
    const __m512 scale = _mm512_set1_ps(a.scale);
    for (int64_t k = 0; k < G; ++k) {
      s[k] = _mm512_mul_ps(s[k], scale);
      if (!full) {
        vis[k] = visible(a, pos, j0 + k, live);
        s[k] = _mm512_mask_blend_ps(vis[k], _mm512_set1_ps(kMasked), s[k]);
      }
      mx = _mm512_max_ps(mx, s[k]);
    }
    const __m512 m_new = _mm512_max_ps(m, mx);
    const __m512 alpha = exp512(_mm512_sub_ps(m, m_new));
    m = m_new;
    l = _mm512_mul_ps(l, alpha);
    __m512bh pp[G / 2];
    for (int64_t k = 0; k < G; k += 2) {
      __m512 pa = exp512(_mm512_sub_ps(s[k], m)), pb = exp512(_mm512_sub_ps(s[k + 1], m));
      if (!full) {
        pa = _mm512_maskz_mov_ps(vis[k], pa);
        pb = _mm512_maskz_mov_ps(vis[k + 1], pb);
      }
      const __m512bh ab = _mm512_cvtne2ps_pbh(pb, pa);  // lanes 0-15: pa, 16-31: pb
      // the sum of what P.V multiplies: the probabilities as rounded to bf16
      const __m512i bits = (__m512i)ab;
      l = _mm512_add_ps(l, widen(_mm512_castsi512_si256(bits)));
      l = _mm512_add_ps(l, widen(_mm512_extracti64x4_epi64(bits, 1)));
      pp[k / 2] = (__m512bh)_mm512_permutexvar_epi16(interleave, bits);
    }
    pv16(ot, D, alpha, pp, vt + r0, ldv);
  }
  store_tile(a, hq, t0, nq, ot, l);
}

#if defined(PAGEDSERVE_PREFILL_AMX)
// The same tile through AMX (CPUs with AMX-BF16), in three passes over the keys it sees instead of
// one online pass: the scores need no rescaling, so P.V can accumulate in tiles.
//
// Why: with AMX, torch's SDPA (its own CPU flash attention) ran a 256-token prefill of SmolLM2 at
// ~0.56 ms a sequence and layer on one core (with the KV gather it needs, a third of a
// 2048-token prefill step on a 2-vCPU Xeon VM, 2026-12-06), and the AVX512-BF16 loop above was
// slower still than that.
//
// 1. S^T [keys][16 queries] a group of 16 keys at a time: C = K rows (A, from kc, 32 features a
//    step) times the tile's query pairs (B: qp, the loop's own layout), stored to sbuf; masked as
//    above, and the lanes' maxima taken (unscaled: the scale enters in step 2).
// 2. P = exp(scale (S - max)) (exp2_bf16) rounded to bf16, two keys' probabilities interleaved
//    per lane (pbuf [keys / 2][16][2]: AMX's pair layout of P^T).
// 3. O^T [D][16] = V^T (A, from vt, 32 keys a step) times P^T (B, from pbuf), a C tile per 16
//    features accumulated over all keys, stored to ot; and l, each lane's sum of its bf16
//    probabilities, as one more such product with a row of ones for A.
// Groups run from a multiple of 32 keys (kc and vt are padded to one) so that step 3 takes whole
// tiles; keys before the first one seen are masked like the rest.
//
// Tiles (16 rows x 64 bytes each): scores 0 and 4 A, 1 B, 2 and 3 C; P.V 0 and 4 A, 1 B, 2, 3, 5,
// 6 and 7 C. A tdpbf16ps waits for the previous one into its C tile, so each step runs two to
// five independent chains.
template <typename T>
T* aligned64(T* p) {
  return reinterpret_cast<T*>((reinterpret_cast<uintptr_t>(p) + 63) & ~uintptr_t{63});
}

void load_prefill_tiles() {
  pagedserve_amx::TileConfig cfg;
  for (int t = 0; t < 8; ++t) cfg.rows[t] = 16, cfg.colsb[t] = 64;
  pagedserve_amx::load_tile_config(cfg);
}

// 2^x for x <= 0, to well within a bf16 rounding (relative error ~5e-5: Taylor's degree 4 on
// [-1/2, 1/2] after splitting off the nearest integer), for probabilities that are rounded to bf16
// next; below -125 it gives 2^-125, a normal float (a denormal costs every instruction that reads
// it a microcode assist). 9 instructions against exp512's 16: the probability pass was the
// tile's largest.
inline __m512 exp2_bf16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-125.0f));
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, n);
  __m512 p = _mm512_fmadd_ps(_mm512_set1_ps(0.009618129f), f, _mm512_set1_ps(0.05550411f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.2402265f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.6931472f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// a row of 32 bf16 ones (A of the probability sums: loaded with stride 0, every row the same)
alignas(64) constexpr uint16_t kOnes[2 * G] = {0x3f80, 0x3f80, 0x3f80, 0x3f80, 0x3f80, 0x3f80, 0x3f80, 0x3f80,
                                               0x3f80, 0x3f80, 0x3f80, 0x3f80, 0x3f80, 0x3f80, 0x3f80, 0x3f80,
                                               0x3f80, 0x3f80, 0x3f80, 0x3f80, 0x3f80, 0x3f80, 0x3f80, 0x3f80,
                                               0x3f80, 0x3f80, 0x3f80, 0x3f80, 0x3f80, 0x3f80, 0x3f80, 0x3f80};

void prefill_tile_amx(const Prefill& a, int64_t hq, int64_t t0, const at::BFloat16* kc, const at::BFloat16* vt,
                      int64_t ldv, std::vector<float>& sbuf, std::vector<int32_t>& pbuf) {
  const int64_t D = a.D, nq = std::min(G, a.T - t0);
  alignas(64) __m512bh qp[128];  // D <= 256
  query_pairs(a, hq, t0, nq, qp);
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i pos = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int32_t>(a.first + t0)), lane);
  const __mmask16 live = static_cast<__mmask16>(nq >= G ? 0xffff : (1u << nq) - 1);
  const int64_t pos_lo = a.first + t0, pos_hi = a.first + t0 + nq - 1;
  const int64_t key_end = std::min(a.seq_len, pos_hi + 1);
  int64_t key_begin = a.kbase;
  if (a.window > 0) key_begin = std::max(key_begin, pos_lo - a.window + 1);
  const int64_t r_begin = (key_begin - a.kbase) / (2 * G) * (2 * G);
  const int64_t r_end = (key_end - a.kbase + 2 * G - 1) / (2 * G) * (2 * G);  // <= ldv
  const int64_t n = r_end - r_begin;
  // both 64-byte aligned (whole zmm rows): 16 spare elements
  if (static_cast<int64_t>(sbuf.size()) < n * G + G) sbuf.resize(n * G + G);
  if (static_cast<int64_t>(pbuf.size()) < n * G / 2 + G) pbuf.resize(n * G / 2 + G);
  float* sb = aligned64(sbuf.data());
  __m512 m = _mm512_set1_ps(kMasked);  // of the unscaled scores (the scale is applied in step 2)
  // 1. scores, two groups of 16 keys at a time: two independent chains of tile products (each
  // tdpbf16ps waits for its accumulator's last one) sharing each B load
  for (int64_t r = 0; r < n; r += 2 * G) {
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t d2 = 0; d2 < D / 2; d2 += G) {
      _tile_loadd(1, qp + d2, 64);
      _tile_loadd(0, kc + (r_begin + r) * D + 2 * d2, D * 2);
      _tile_dpbf16ps(2, 0, 1);
      _tile_loadd(4, kc + (r_begin + r + G) * D + 2 * d2, D * 2);
      _tile_dpbf16ps(3, 4, 1);
    }
    _tile_stored(2, sb + r * G, 64);
    _tile_stored(3, sb + (r + G) * G, 64);
    for (int64_t g = r; g < r + 2 * G; g += G) {
      const int64_t j0 = a.kbase + r_begin + g;
      float* s = sb + g * G;
      const bool full = j0 + G - 1 <= pos_lo && j0 + G <= a.seq_len && (a.window <= 0 || j0 > pos_hi - a.window);
      if (full) {
        __m512 m0 = _mm512_load_ps(s), m1 = _mm512_load_ps(s + G);
        for (int64_t k = 2; k < G; k += 2)
          m0 = _mm512_max_ps(m0, _mm512_load_ps(s + k * G)), m1 = _mm512_max_ps(m1, _mm512_load_ps(s + (k + 1) * G));
        m = _mm512_max_ps(m, _mm512_max_ps(m0, m1));
        continue;
      }
      for (int64_t k = 0; k < G; ++k) {
        const __m512 v = _mm512_mask_blend_ps(visible(a, pos, j0 + k, live), _mm512_set1_ps(kMasked),
                                              _mm512_load_ps(s + k * G));
        _mm512_store_ps(s + k * G, v);
        m = _mm512_max_ps(m, v);
      }
    }
  }
  // 2. probabilities: a masked score (kMasked) gives 2^-125, nothing beside the 1 of a lane's
  // largest score (every live lane sees its own position; the dead lanes' sums are never read)
  const __m512i interleave = pagedserve_amx::pair_interleave();
  // in base 2: p = 2^(s c - m c), c = scale log2(e)
  const __m512 c = _mm512_set1_ps(a.scale * 1.4426950408889634f), mc = _mm512_mul_ps(m, c);
  int32_t* pb = aligned64(pbuf.data());
  for (int64_t k = 0; k < n; k += 2) {
    const __m512 pa = exp2_bf16(_mm512_fmsub_ps(_mm512_load_ps(sb + k * G), c, mc));
    const __m512 pbv = exp2_bf16(_mm512_fmsub_ps(_mm512_load_ps(sb + (k + 1) * G), c, mc));
    const __m512i bits = (__m512i)_mm512_cvtne2ps_pbh(pbv, pa);  // lanes 0-15: pa, 16-31: pb
    _mm512_store_si512(pb + k / 2 * G, _mm512_permutexvar_epi16(interleave, bits));
  }
  // 3. O^T = V^T P^T; and l, each lane's sum of its bf16 probabilities, as a row of ones times P^T.
  // Up to four blocks of 16 features (C tiles 2, 3, 5, 6) and the ones (7) a round over the keys:
  // independent chains sharing each load of P^T (B, 1); A alternates between tiles 0 and 4.
  alignas(64) float ot[(128 + G) * G];  // D <= 128 rows, then the ones' row block
  for (int64_t f0 = 0; f0 < D; f0 += 4 * G) {
    const int64_t nf = std::min<int64_t>(4, (D - f0) / G);  // D % 32 == 0: 2 or 4
    const bool ones = f0 == 0;
    _tile_zero(2);
    _tile_zero(3);
    if (nf > 2) {
      _tile_zero(5);
      _tile_zero(6);
    }
    if (ones) _tile_zero(7);
    const at::BFloat16* v0 = vt + f0 * ldv + r_begin;
    for (int64_t r = 0; r < n; r += 2 * G) {
      _tile_loadd(1, pb + r / 2 * G, 64);
      _tile_loadd(0, v0 + r, ldv * 2);
      _tile_dpbf16ps(2, 0, 1);
      _tile_loadd(4, v0 + G * ldv + r, ldv * 2);
      _tile_dpbf16ps(3, 4, 1);
      if (nf > 2) {
        _tile_loadd(0, v0 + 2 * G * ldv + r, ldv * 2);
        _tile_dpbf16ps(5, 0, 1);
        _tile_loadd(4, v0 + 3 * G * ldv + r, ldv * 2);
        _tile_dpbf16ps(6, 4, 1);
      }
      if (ones) {
        _tile_loadd(0, kOnes, 0);
        _tile_dpbf16ps(7, 0, 1);
      }
    }
    _tile_stored(2, ot + f0 * G, 64);
    _tile_stored(3, ot + (f0 + G) * G, 64);
    if (nf > 2) {
      _tile_stored(5, ot + (f0 + 2 * G) * G, 64);
      _tile_stored(6, ot + (f0 + 3 * G) * G, 64);
    }
    if (ones) _tile_stored(7, ot + D * G, 64);
  }
  store_tile(a, hq, t0, nq, ot, _mm512_load_ps(ot + D * G));
}
#endif
#endif

}  // namespace

bool prefill_bf16_available() {
#if defined(PAGEDSERVE_PREFILL_BF16)
  return true;
#else
  return false;
#endif
}

// whether paged_prefill can run on AMX tiles here (built for AMX-BF16, and Linux granted the tiles)
bool prefill_amx_available() {
#if defined(PAGEDSERVE_PREFILL_AMX)
  return blocks_amx_available();
#else
  return false;
#endif
}

// Attention of one sequence's prefill chunk: q [T, Hq, D] (its positions seq_len - T .. seq_len - 1)
// over its KV in the pools [blocks, block_size, Hkv, D] through its block table (int32, blocks from
// position 0 on), causal, and with a sliding window of `window` keys when window > 0. bf16 only.
// On AMX tiles where `use_amx` and prefill_amx_available() (head dims of 32, 64, 96 or 128: whole
// tile steps of 32 features), else the loop.
at::Tensor paged_prefill(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                         const at::Tensor& table, int64_t seq_len, double scale, int64_t window, bool use_amx) {
  TORCH_CHECK(prefill_bf16_available(), "paged_prefill: built without AVX512-BF16");
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && k_cache.scalar_type() == at::kBFloat16 &&
                  v_cache.scalar_type() == at::kBFloat16, "paged_prefill: bf16 only");
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes(), "paged_prefill: bad shapes");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "paged_prefill: pools must be contiguous");
  TORCH_CHECK(table.scalar_type() == at::kInt && table.dim() == 1, "paged_prefill: an int32 block table row");
  const int64_t T = q.size(0), Hq = q.size(1), D = q.size(2);
  const int64_t bs = k_cache.size(1), Hkv = k_cache.size(2), num_blocks = k_cache.size(0);
  TORCH_CHECK(k_cache.size(3) == D && D % 16 == 0 && D <= 256,
              "paged_prefill: head dim must be a multiple of 16, <= 256");
  TORCH_CHECK(Hq % Hkv == 0, "paged_prefill: query heads must be a multiple of KV heads");
  TORCH_CHECK(T >= 1 && seq_len >= T && table.size(0) * bs >= seq_len, "paged_prefill: the table is too short");
  const at::Tensor qc = q.contiguous();
  at::Tensor out = at::empty_like(qc);
#if defined(PAGEDSERVE_PREFILL_BF16)
  const int64_t first = seq_len - T;
  // keys before the first query's window are never read
  const int64_t kbase = window > 0 ? std::max<int64_t>(0, first - window + 1) : 0;
  const int64_t L = seq_len - kbase, Lp = (L + 2 * G - 1) / (2 * G) * (2 * G);  // whole AMX steps of 32 keys
  // K gathered [Hkv][Lp][D] and V transposed [Hkv][D][Lp], zero past the last key
  at::Tensor kc = at::zeros({Hkv, Lp, D}, qc.options());
  at::Tensor vt = at::zeros({Hkv, D, Lp}, qc.options());
  const int32_t* tab = table.contiguous().data_ptr<int32_t>();
  const at::BFloat16* kp = k_cache.data_ptr<at::BFloat16>();
  const at::BFloat16* vp = v_cache.data_ptr<at::BFloat16>();
  at::BFloat16* kcp = kc.data_ptr<at::BFloat16>();
  at::BFloat16* vtp = vt.data_ptr<at::BFloat16>();
  for (int64_t i = kbase / bs; i <= (seq_len - 1) / bs; ++i)  // the blocks read below
    TORCH_CHECK(tab[i] >= 0 && tab[i] < num_blocks, "paged_prefill: block ", tab[i], " is outside the pool");
  pagedserve_pool::rows_for(Hkv, 1, [&](int64_t h0, int64_t h1) {
    for (int64_t h = h0; h < h1; ++h)
      for (int64_t j = kbase; j < seq_len; ++j) {
        const int64_t slot = static_cast<int64_t>(tab[j / bs]) * bs + j % bs;
        std::memcpy(kcp + (h * Lp + j - kbase) * D, kp + (slot * Hkv + h) * D, D * sizeof(at::BFloat16));
        const at::BFloat16* v = vp + (slot * Hkv + h) * D;
        for (int64_t d = 0; d < D; ++d) vtp[(h * D + d) * Lp + j - kbase] = v[d];
      }
  });
  const Prefill a{qc.data_ptr<at::BFloat16>(), out.data_ptr<at::BFloat16>(), T, Hq, Hkv, D, first, seq_len, kbase,
                  window, static_cast<float>(scale)};
  const int64_t tiles = (T + G - 1) / G, group = Hq / Hkv;
#if defined(PAGEDSERVE_PREFILL_AMX)
  if (use_amx && D % 32 == 0 && D <= 128 && prefill_amx_available()) {
    pagedserve_pool::rows_for(Hq * tiles, 1, [&](int64_t w0, int64_t w1) {
      thread_local std::vector<float> sbuf;
      thread_local std::vector<int32_t> pbuf;
      load_prefill_tiles();
      for (int64_t w = w0; w < w1; ++w) {
        const int64_t hq = w / tiles, t0 = (w % tiles) * G, h = hq / group;
        prefill_tile_amx(a, hq, t0, kcp + h * Lp * D, vtp + h * D * Lp, Lp, sbuf, pbuf);
      }
      _tile_release();
    });
    return out;
  }
#endif
  (void)use_amx;
  pagedserve_pool::rows_for(Hq * tiles, 1, [&](int64_t w0, int64_t w1) {
    for (int64_t w = w0; w < w1; ++w) {
      const int64_t hq = w / tiles, t0 = (w % tiles) * G, h = hq / group;
      prefill_tile(a, hq, t0, kcp + h * Lp * D, vtp + h * D * Lp, Lp);
    }
  });
#else
  (void)use_amx;
#endif
  return out;
}
