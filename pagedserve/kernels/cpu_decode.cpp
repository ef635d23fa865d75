// Paged decode attention on CPU: one query token per sequence, KV read in place through the block
// table (no gather into a workspace). The torch reference (reference.py) is its oracle.
//
// Layout (as reference.py): q [B, Hq, D]; k_cache, v_cache [num_blocks, block_size, Hkv, D];
// block_tables int32 [B, max_blocks]; seq_lens int32 [B] (KV length including this token).
// Query head h reads KV head h / (Hq / Hkv). Token positions p < seq_len are visible, and
// p >= seq_len - window when window > 0. Two passes over each sequence's keys (scores, then the
// weighted sum of V), accumulated in fp32; sequences whose tables begin with the same blocks read
// those once for all of them (visit_sequences). A sequence with no visible key gets zeros.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <utility>
#include <type_traits>
#include <vector>

#include "cpu_kernels.h"
#include "cpu_pool.h"
#include "cpu_vec.h"
#if defined(__AVX512BF16__) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include "cpu_amx.h"
#define PAGEDSERVE_DECODE_AMX 1
#endif

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
  int64_t i = 0;
#if defined(__AVX512F__)
  if (n >= 64) {  // four chains: one waits on vmaxps' latency every 16 scores
    __m512 m0 = _mm512_loadu_ps(scores), m1 = m0, m2 = m0, m3 = m0;
    for (; i + 64 <= n; i += 64) {
      m0 = _mm512_max_ps(m0, _mm512_loadu_ps(scores + i));
      m1 = _mm512_max_ps(m1, _mm512_loadu_ps(scores + i + 16));
      m2 = _mm512_max_ps(m2, _mm512_loadu_ps(scores + i + 32));
      m3 = _mm512_max_ps(m3, _mm512_loadu_ps(scores + i + 48));
    }
    m = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_max_ps(m0, m1), _mm512_max_ps(m2, m3)));
  }
#endif
  for (; i < n; ++i) m = std::max(m, scores[i]);
  float sum = 0.0f;
  i = 0;
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

// The scratch of one sequence in a decode task: its visible keys [start, len) in table entries
// [first, last]; its query rows in fp32, scaled (the kernels that widen q); scores [Hq, n], then
// their exponentials; the P . V accumulators [Hq, D]; one K or V row widened (the generic loop).
struct Slot {
  int64_t b = 0, start = 0, len = 0, n = 0, first = 0, last = 0;
  std::vector<float> qf, scores, acc, inv, row;
  // the visible keys [t0, t1) of table entry j, with blocks of bs tokens
  std::pair<int64_t, int64_t> keys(int64_t j, int64_t bs) const {
    return {std::max(start, j * bs), std::min(len, (j + 1) * bs)};
  }
};

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

  // Sequence b's query rows in fp32, times scale, into qf [Hq, D].
  void scaled_query(int64_t b, float scale, std::vector<float>& qf) const {
    qf.resize(Hq * D);
    for (int64_t h = 0; h < Hq; ++h) {
      to_float(qp + b * qs_b + h * qs_h, qf.data() + h * D, D);
      for (int64_t d = 0; d < D; ++d) qf[h * D + d] *= scale;
    }
  }

  // The slots of sequences order[0 .. count) that see a key (zero output rows for the others),
  // their scratch sized and zeroed; returns how many.
  int64_t begin_slots(const int64_t* order, int64_t count, int64_t window, std::vector<Slot>& slots) const {
    if (static_cast<int64_t>(slots.size()) < count) slots.resize(count);
    int64_t live = 0;
    for (int64_t k = 0; k < count; ++k) {
      const int64_t b = order[k], len = lens[b], start = first_key(b, window);
      if (len - start <= 0) {
        store_zeros(b);
        continue;
      }
      Slot& s = slots[live++];
      s.b = b, s.start = start, s.len = len, s.n = len - start, s.first = start / bs, s.last = (len - 1) / bs;
      s.scores.resize(Hq * s.n);
      s.acc.assign(Hq * D, 0.0f);
      s.inv.resize(Hq);
    }
    return live;
  }

  // How many leading table entries every one of the slots has in common (0 for one slot; runs of
  // more than one start at key 0).
  int64_t shared_entries(const Slot* slots, int64_t live) const {
    int64_t shared = live > 1 ? slots[0].last + 1 : 0;
    for (int64_t k = 1; k < live && shared > 0; ++k) {
      const int32_t* lead_row = tables + slots[0].b * max_blocks;
      const int32_t* row = tables + slots[k].b * max_blocks;
      int64_t e = 0;
      const int64_t limit = std::min(shared, slots[k].last + 1);
      while (e < limit && row[e] == lead_row[e]) ++e;
      shared = e;
    }
    return shared;
  }

  // Sequence b's output rows: acc [Hq, D], each head's row times inv[head].
  void store(int64_t b, const float* acc, const float* inv) const {
    for (int64_t hq = 0; hq < Hq; ++hq)
      for (int64_t d = 0; d < D; ++d) op[b * os_b + hq * os_h + d] = T(acc[hq * D + d] * inv[hq]);
  }
};

constexpr int64_t kMaxGroup = 64;  // sequences visited together over their shared blocks

// The order in which one call visits its sequences: where `group`, those whose tables begin with
// the same block (the same lead) next to each other, in runs of those that share blocks; else one
// sequence after another.
struct SharingOrder {
  bool group = false;
  std::vector<int64_t> order;  // the sequences in visiting order
  std::vector<int64_t> lead;   // per sequence where group: its first block (-1 - b where it sees no key)

  // The end of the run that begins at order[i]: up to `most` sequences of [i, end) with one lead
  // where group, else order[i] alone.
  int64_t run_end(int64_t i, int64_t end, int64_t most) const {
    int64_t r = i + 1;
    if (group)
      while (r < end && r - i < most && lead[order[r]] == lead[order[i]]) ++r;
    return r;
  }

  // fn(seqs, count) for each run of up to kMaxGroup sequences of order [begin, end).
  template <typename Fn>
  void for_each_run(int64_t begin, int64_t end, const Fn& fn) const {
    for (int64_t i = begin; i < end;) {
      const int64_t r = run_end(i, end, kMaxGroup);
      fn(order.data() + i, r - i);
      i = r;
    }
  }
};

// The visiting order of pg's sequences: grouped where `group`, no window and more than one.
template <typename T>
SharingOrder sharing_order(const Paged<T>& pg, int64_t window, bool group) {
  SharingOrder seqs;
  seqs.group = group && window <= 0 && pg.B > 1;
  seqs.order.resize(pg.B);
  std::iota(seqs.order.begin(), seqs.order.end(), int64_t{0});
  if (!seqs.group) return seqs;
  seqs.lead.resize(pg.B);
  for (int64_t b = 0; b < pg.B; ++b) seqs.lead[b] = pg.lens[b] > 0 ? pg.block(b, 0) : -1 - b;
  std::stable_sort(seqs.order.begin(), seqs.order.end(),
                   [&](int64_t x, int64_t y) { return seqs.lead[x] < seqs.lead[y]; });
  return seqs;
}

// Runs task(begin, end, scratch) over the positions of seqs.order: one task over all of it where
// one thread serves, else over units.
template <typename Scratch, typename Task>
void run_units(const SharingOrder& seqs, int64_t threads, const Task& task) {
  // On `threads` threads (<= 0: torch's count; the caller may ask for more threads than the rest
  // of its step runs on, where the KV to read makes this region long), each taking the next unit
  // of the order as it finishes one: a thread on a core busy with something else (served, the HTTP
  // stack's) then leaves its share to the others instead of holding up the region. Units: one
  // sequence, or up to kPiece of a run sharing blocks (each unit reads those blocks once).
  const int64_t B = static_cast<int64_t>(seqs.order.size());
  pagedserve_pool::Pool& pool = pagedserve_pool::Pool::get();
  const bool pooled = threads <= 0 && pool.helpers() > 0 && !at::in_parallel_region();
  const int64_t nt = pooled ? B : std::min<int64_t>(B, threads > 0 ? threads : at::get_num_threads());
  if (nt <= 1 || at::in_parallel_region()) {
    Scratch scratch;
    task(0, B, scratch);
    return;
  }
  constexpr int64_t kPiece = 4;
  std::vector<std::pair<int64_t, int64_t>> units;
  for (int64_t i = 0; i < B; i = units.back().second) units.emplace_back(i, seqs.run_end(i, B, kPiece));
  const int64_t num_units = static_cast<int64_t>(units.size());
  if (pooled) {  // the decode pool's threads (cpu_pool.h), one scratch each
    std::vector<Scratch> scratch(pool.helpers() + 1);
    pool.run(num_units, [&](int64_t u, int worker) { task(units[u].first, units[u].second, scratch[worker]); });
    return;
  }
  std::atomic<int64_t> next_unit{0};
#pragma omp parallel num_threads(static_cast<int>(nt))
  {
    Scratch scratch;
    for (int64_t u = next_unit++; u < num_units; u = next_unit++) task(units[u].first, units[u].second, scratch);
  }
}

// Runs a decode kernel over the sequences of one call. Sequences whose tables begin with the same
// blocks (a prompt prefix cached once and shared by reference, the forks of one request) are
// visited block-major over those leading blocks, so each shared block is read from memory once for
// all of them (once per unit of work, on several threads), then each sequence's own blocks in
// order; where none share (or group is false) that is one sequence after another, each block once.
// Both passes keep every sequence's scores, so the visiting order changes no result. The kernel
// provides begin(slot) (its query rows), and scores(slot, j, blk, next) and pv(slot, j, blk, next):
// the keys of table entry j, held at blk; next is the block read after this one (nullptr: none, or
// already in cache), for it to prefetch.
template <typename T, typename Kern>
void visit_sequences(const Paged<T>& pg, int64_t window, bool group, int64_t threads, const Kern& kern) {
  const int64_t Hq = pg.Hq, block_stride = pg.block_stride;
  const SharingOrder seqs = sharing_order(pg, window, group);

  struct Step {
    int64_t slot, j, block;
  };
  struct Scratch {
    std::vector<Slot> slots;
    std::vector<Step> walk;  // (slot, table entry, pool block) in visiting order
    std::vector<int64_t> stream, at;
  };
  auto task = [&](int64_t begin, int64_t end, Scratch& scratch) {
    std::vector<Slot>& slots = scratch.slots;
    std::vector<Step>& walk = scratch.walk;
    std::vector<int64_t>& stream = scratch.stream;
    std::vector<int64_t>& at = scratch.at;
    seqs.for_each_run(begin, end, [&](const int64_t* run, int64_t count) {
      const int64_t live = pg.begin_slots(run, count, window, slots);
      for (int64_t k = 0; k < live; ++k) kern.begin(slots[k]);
      const int64_t shared = pg.shared_entries(slots.data(), live);
      walk.clear();
      for (int64_t j = 0; j < shared; ++j)
        for (int64_t k = 0; k < live; ++k) walk.push_back({k, j, pg.block(slots[k].b, j)});
      for (int64_t k = 0; k < live; ++k)
        for (int64_t j = std::max(slots[k].first, shared); j <= slots[k].last; ++j)
          walk.push_back({k, j, pg.block(slots[k].b, j)});
      const int64_t steps = static_cast<int64_t>(walk.size());
      // the blocks in the order first read: K in walk order, then V; step w of pass p first reads
      // stream[p * distinct + at[w]] where it starts a run of its block
      stream.clear();
      at.resize(steps);
      for (int64_t w = 0; w < steps; ++w) {
        if (w == 0 || walk[w].block != walk[w - 1].block) stream.push_back(walk[w].block);
        at[w] = static_cast<int64_t>(stream.size()) - 1;
      }
      const int64_t distinct = static_cast<int64_t>(stream.size());
      for (int pass = 0; pass < 2; ++pass) {
        const T* cache = pass == 0 ? pg.kp : pg.vp;
        for (int64_t w = 0; w < steps; ++w) {
          const Step& st = walk[w];
          const T* next = nullptr;
          if (w == 0 || walk[w - 1].block != st.block) {  // the first visit of this block
            const int64_t ahead = pass * distinct + at[w] + 1;
            if (ahead < 2 * distinct)
              next = (ahead < distinct ? pg.kp : pg.vp) + stream[ahead % distinct] * block_stride;
          }
          const T* blk = cache + st.block * block_stride;
          if (pass == 0) kern.scores(slots[st.slot], st.j, blk, next);
          else kern.pv(slots[st.slot], st.j, blk, next);
        }
        if (pass == 0)
          for (int64_t k = 0; k < live; ++k)
            for (int64_t hq = 0; hq < Hq; ++hq)
              slots[k].inv[hq] = 1.0f / exp_shifted(slots[k].scores.data() + hq * slots[k].n, slots[k].n);
      }
      for (int64_t k = 0; k < live; ++k) pg.store(slots[k].b, slots[k].acc.data(), slots[k].inv.data());
    });
  };
  run_units<Scratch>(seqs, threads, task);
}

template <typename T>
void decode(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
            const at::Tensor& block_tables, const at::Tensor& seq_lens, at::Tensor& out, double scale,
            int64_t window, bool group, int64_t threads) {
  const Paged<T> pg(q, k_cache, v_cache, block_tables, seq_lens, out);
  // Each block's rows are read whole and in order (K, then V), every KV head of a token row at
  // once, each K or V row widened once for the G query heads that read it.
  struct Kern {
    const Paged<T>& pg;
    float fscale;
    void begin(Slot& s) const {
      pg.scaled_query(s.b, fscale, s.qf);
      s.row.resize(pg.Hkv * pg.D);
    }
    void scores(Slot& s, int64_t j, const T* blk, const T* next) const {
      const int64_t Hq = pg.Hq, D = pg.D, G = pg.G, bs = pg.bs, n = s.n, start = s.start;
      if (next) prefetch(next, pg.block_stride * sizeof(T));
      const auto [t0, t1] = s.keys(j, bs);
#if defined(__AVX512F__)
      if constexpr (kVectorized<T>) {
        if (D % 16 == 0 && D <= 256) {
          for (int64_t c0 = t0; c0 < t1; c0 += 16)
            block_scores(s.qf.data(), blk, c0 - j * bs, c0, std::min(t1, c0 + 16), start, n, pg.Hkv, G, D,
                         s.scores.data());
          return;
        }
      }
#endif
      for (int64_t t = t0; t < t1; ++t) {
        to_float(blk + (t - j * bs) * pg.row_stride, s.row.data(), pg.Hkv * D);
        for (int64_t hq = 0; hq < Hq; ++hq) {
          const float* r = s.row.data() + (hq / G) * D;
          const float* qh = s.qf.data() + hq * D;
          float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
          for (int64_t d = 0; d < D; ++d) sum += qh[d] * r[d];
          s.scores[hq * n + (t - start)] = sum;
        }
      }
    }
    void pv(Slot& s, int64_t j, const T* blk, const T* next) const {
      const int64_t Hq = pg.Hq, D = pg.D, G = pg.G, bs = pg.bs, n = s.n, start = s.start;
      if (next) prefetch(next, pg.block_stride * sizeof(T));
      const auto [t0, t1] = s.keys(j, bs);
      for (int64_t t = t0; t < t1; ++t) {
        to_float(blk + (t - j * bs) * pg.row_stride, s.row.data(), pg.Hkv * D);
        for (int64_t hq = 0; hq < Hq; ++hq) {
          const float* r = s.row.data() + (hq / G) * D;
          const float p = s.scores[hq * n + (t - start)];
          float* ah = s.acc.data() + hq * D;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) ah[d] += p * r[d];
        }
      }
    }
  };
  visit_sequences(pg, window, group, threads, Kern{pg, static_cast<float>(scale)});
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
                 int64_t window, bool group, int64_t threads) {
  using T = at::BFloat16;
  const Paged<T> pg(q, k_cache, v_cache, block_tables, seq_lens, out);
  struct Kern {
    // locals: the vector stores below may alias pg's fields
    int64_t Hq, D, bs, Hkv, G, row_stride, qs_b, qs_h, nc, ch, block_lines;
    const T* qp;
    __m512 vscale;
    // part i of `parts` of the block at p, asked for ahead of use: blocks sit at random places in
    // the pool, and one prefetch burst of a whole block stalls on the fill buffers
    void prefetch_part(const T* p, int64_t i, int64_t parts) const {
      const char* c = reinterpret_cast<const char*>(p);
      for (int64_t l = block_lines * i / parts; l < block_lines * (i + 1) / parts; ++l)
        __builtin_prefetch(c + 64 * l, 0, 3);
    }
    void begin(Slot&) const {}  // q is read in place, bf16
    void scores(Slot& s, int64_t j, const T* blk, const T* next) const {
      const T* qb = qp + s.b * qs_b;
      const int64_t n = s.n, start = s.start;
      const auto [t0, t1] = s.keys(j, bs);
      for (int64_t c0 = t0; c0 < t1; c0 += 16) {
        const int64_t count = std::min<int64_t>(t1 - c0, 16);
        const __mmask16 mask = count >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << count) - 1);
        const T* rows = blk + (c0 - j * bs) * row_stride;
        for (int64_t hq = 0; hq < Hq; ++hq) {
          if (next) prefetch_part(next, hq, Hq);
          const T* qh = qb + hq * qs_h;
          const T* kh = rows + (hq / G) * D;
          __m512 sv;
          switch (nc) {
            case 1: sv = scores16<1>(qh, kh, row_stride, count); break;
            case 2: sv = scores16<2>(qh, kh, row_stride, count); break;
            case 3: sv = scores16<3>(qh, kh, row_stride, count); break;
            case 4: sv = scores16<4>(qh, kh, row_stride, count); break;
            default: sv = scores16<8>(qh, kh, row_stride, count); break;
          }
          _mm512_mask_storeu_ps(s.scores.data() + hq * n + (c0 - start), mask, _mm512_mul_ps(sv, vscale));
        }
      }
    }
    void pv(Slot& s, int64_t j, const T* blk, const T* next) const {
      const int64_t n = s.n, start = s.start;
      const auto [t0, t1] = s.keys(j, bs);
      const T* rows = blk + (t0 - j * bs) * row_stride;
      for (int64_t h = 0; h < Hkv; ++h) {
        if (next) prefetch_part(next, h, Hkv);
        for (int64_t g0 = 0; g0 < G; g0 += 4) {
          const int64_t gn = std::min<int64_t>(4, G - g0);
          const float* p = s.scores.data() + (h * G + g0) * n + (t0 - start);
          for (int64_t c = 0; c < D / 16; c += ch) {
            float* a = s.acc.data() + (h * G + g0) * D + 16 * c;
            const T* v = rows + h * D + 16 * c;
            if (ch == 4) pv_heads<4>(gn, a, D, v, row_stride, p, n, t1 - t0);
            else pv_heads<2>(gn, a, D, v, row_stride, p, n, t1 - t0);
          }
        }
      }
    }
  };
  const int64_t D = pg.D;
  const Kern kern{pg.Hq, D, pg.bs, pg.Hkv, pg.G, pg.row_stride, pg.qs_b, pg.qs_h, D / 32,
                  (D / 16) % 4 == 0 ? 4 : 2,  // D % 32 == 0
                  (pg.block_stride * static_cast<int64_t>(sizeof(T)) + 63) / 64, pg.qp,
                  _mm512_set1_ps(static_cast<float>(scale))};
  visit_sequences(pg, window, group, threads, kern);
}

#if defined(PAGEDSERVE_DECODE_AMX)
// bf16 decode on AMX tiles (CPUs with AMX-BF16 whose OS grants the tiles), for block sizes that
// are a multiple of 16 and head dims a multiple of 32. The work is cut into row sets: up to 16
// query rows of one KV head, as (sequence, query head) pairs. Over the leading blocks that the
// sequences of a task share (a cached prompt prefix, the forks of one request) a row set holds
// the rows of all of them, so one tile product serves every sequence that reads the block; over
// a sequence's own blocks, its own rows.
//
// Why: in a served decode step over a shared 512-token prefix (16 sequences of ~800 tokens,
// SmolLM2 bf16, 2-vCPU Xeon with AMX) the vdpbf16ps kernel above took 35% of the engine's samples,
// each sequence doing its own arithmetic over the shared blocks (read once, but computed 16 times).
//
// 1. Scores, 16 keys a time: S^T [16 keys][rows] = K (A: the block's rows of the head read in
//    place, 32 features a step) times Q^T (B: the rows' queries as feature pairs, made once a
//    task); each row's column gathered into its sequence's scores, times the scale. Every score
//    is a dot product of its own, so a row's scores do not depend on the set it was computed in.
// 2. The softmax of the loop above (fp32 exponentials, their fp32 sum for the normalization).
// 3. O [rows][D] += P (A: the rows' probabilities of 16 keys rounded to bf16, as flash attention
//    does in bf16) times V (B: the 16 keys' values as pairs of keys, 16 features a tile; zero past
//    the last key any row sees, so that no unwritten slot of the pool enters a sum), the
//    accumulators in tiles over the blocks of a phase, then stored to the sequences' own. A row
//    goes through the same products in the same order whether or not its leading blocks were
//    shared: the visiting order changes no result, as in the loop above.
namespace decode_amx {

constexpr int64_t kRows = 16;  // query rows a tile
constexpr int64_t kKeys = 16;  // keys a step

struct RowSet {  // up to kRows query rows of KV head h: rows m are (slot[m], query head hq[m])
  int64_t h = 0, count = 0;
  int64_t slot[kRows] = {}, hq[kRows] = {};
};

// Tiles of the scores: 0 K rows (A, 16 keys x 32 features), 1 Q^T (B, 16 feature pairs x 16
// rows), 2 S^T (C, 16 keys x 16 rows fp32).
inline void scores_tiles() {
  pagedserve_amx::TileConfig cfg;
  for (int t = 0; t < 3; ++t) cfg.rows[t] = 16, cfg.colsb[t] = 64;
  pagedserve_amx::load_tile_config(cfg);
}

// Tiles of P . V: 0 P (A, 16 rows x 16 keys bf16), 1 and 2 V (B, 8 key pairs x 16 features),
// 3-6 O (C, 16 rows x 16 features fp32): 64 features a round over the keys.
inline void pv_tiles() {
  pagedserve_amx::TileConfig cfg;
  cfg.rows[0] = 16, cfg.colsb[0] = 32;
  for (int t = 1; t < 3; ++t) cfg.rows[t] = 8, cfg.colsb[t] = 64;
  for (int t = 3; t < 7; ++t) cfg.rows[t] = 16, cfg.colsb[t] = 64;
  pagedserve_amx::load_tile_config(cfg);
}

// One phase of a task: row sets [s0, s1) over table entries [j0, j1] of slot `ref` (the slots of
// the sets have these entries in common), keys [lo, hi) (any key of a slot outside its own range
// is skipped).
struct Phase {
  int64_t ref, j0, j1, lo, hi, s0, s1;
};

struct Scratch {
  std::vector<Slot> slots;
  std::vector<RowSet> sets;  // every phase's, made once a task for both the scores and P . V
  std::vector<Phase> phases;
  std::vector<uint32_t> qt;  // a phase's, per set, per step of 32 features: [16 feature pairs][16 rows]
  std::vector<float> acc;    // one set's accumulators [16][D]
};

// Appends the row sets of slots [k0, k1) to x.sets (every KV head; the rows of a head in order).
inline void add_sets(const Paged<at::BFloat16>& pg, Scratch& x, int64_t k0, int64_t k1) {
  for (int64_t h = 0; h < pg.Hkv; ++h) {
    RowSet cur;
    cur.h = h;
    for (int64_t k = k0; k < k1; ++k)
      for (int64_t g = 0; g < pg.G; ++g) {
        if (cur.count == kRows) {
          x.sets.push_back(cur);
          cur = RowSet();
          cur.h = h;
        }
        cur.slot[cur.count] = k, cur.hq[cur.count] = h * pg.G + g, ++cur.count;
      }
    if (cur.count > 0) x.sets.push_back(cur);
  }
}

// The phases of a task's `live` slots, whose first `shared` table entries are common to all: the
// shared blocks for every slot's rows at once, then each slot's own blocks.
inline void plan_phases(const Paged<at::BFloat16>& pg, Scratch& x, int64_t live, int64_t shared) {
  x.sets.clear();
  x.phases.clear();
  auto add = [&](int64_t ref, int64_t j0, int64_t j1, int64_t lo, int64_t hi, int64_t k0, int64_t k1) {
    const int64_t s0 = static_cast<int64_t>(x.sets.size());
    add_sets(pg, x, k0, k1);
    x.phases.push_back({ref, j0, j1, lo, hi, s0, static_cast<int64_t>(x.sets.size())});
  };
  if (shared > 0) {
    int64_t hi = 0;  // the shared phase's keys: [0, the longest slot's last)
    for (int64_t k = 0; k < live; ++k) hi = std::max(hi, x.slots[k].len);
    add(0, 0, shared - 1, 0, std::min(hi, shared * pg.bs), 0, live);
  }
  for (int64_t k = 0; k < live; ++k) {
    const Slot& s = x.slots[k];
    if (std::max(s.first, shared) <= s.last) add(k, std::max(s.first, shared), s.last, s.start, s.len, k, k + 1);
  }
}

// Q^T of the phase's row sets into x.qt.
inline void pack_queries(const Paged<at::BFloat16>& pg, Scratch& x, const Phase& ph) {
  const int64_t steps = pg.D / 32;
  x.qt.assign((ph.s1 - ph.s0) * steps * 256, 0u);
  for (int64_t si = ph.s0; si < ph.s1; ++si) {
    const RowSet& set = x.sets[si];
    for (int64_t m = 0; m < set.count; ++m) {
      const uint32_t* q32 =
          reinterpret_cast<const uint32_t*>(pg.qp + x.slots[set.slot[m]].b * pg.qs_b + set.hq[m] * pg.qs_h);
      uint32_t* dst = x.qt.data() + (si - ph.s0) * steps * 256 + m;
      for (int64_t p = 0; p < steps * 16; ++p) dst[(p / 16) * 256 + (p % 16) * 16] = q32[p];
    }
  }
}

// lanes [a - u0, e - u0) of a step of 16 keys from u0
inline __mmask16 key_mask(int64_t u0, int64_t a, int64_t e) {
  if (a >= e) return 0;
  const uint32_t hi = (e - u0 >= 16) ? 0xFFFFu : ((1u << (e - u0)) - 1u);
  const uint32_t lo = (1u << (a - u0)) - 1u;
  return static_cast<__mmask16>(hi & ~lo);
}

// The scores of a phase's row sets, into their slots' scores.
inline void scores(const Paged<at::BFloat16>& pg, Scratch& x, const Phase& ph, float scale) {
  const int64_t D = pg.D, bs = pg.bs, steps = D / 32, ld = pg.row_stride * 2;
  const int64_t ref = ph.ref, j0 = ph.j0, j1 = ph.j1, lo = ph.lo, hi = ph.hi;
  pack_queries(pg, x, ph);
  alignas(64) float c[kKeys * kRows];
  const __m512i lane16 = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                            _mm512_set1_epi32(kRows));
  const __m512 vscale = _mm512_set1_ps(scale);
  for (int64_t j = j0; j <= j1; ++j) {
    const at::BFloat16* blk = pg.kp + pg.block(x.slots[ref].b, j) * pg.block_stride;
    // the next block's rows of a head asked for as each head's first set starts on this block's
    // (one burst for the whole block stalls on the fill buffers)
    const at::BFloat16* next = j < j1 ? pg.kp + pg.block(x.slots[ref].b, j + 1) * pg.block_stride : nullptr;
    for (int64_t u0 = std::max(j * bs, lo / kKeys * kKeys); u0 < std::min((j + 1) * bs, hi); u0 += kKeys) {
      const at::BFloat16* rows = blk + (u0 - j * bs) * pg.row_stride;
      for (int64_t si = ph.s0; si < ph.s1; ++si) {
        const RowSet& set = x.sets[si];
        if (next && (si == ph.s0 || x.sets[si - 1].h != set.h))
          for (int64_t t = 0; t < kKeys; ++t)
            prefetch(next + (u0 - j * bs + t) * pg.row_stride + set.h * D, D * 2);
        _tile_zero(2);
        for (int64_t st = 0; st < steps; ++st) {
          _tile_loadd(0, rows + set.h * D + 32 * st, ld);
          _tile_loadd(1, x.qt.data() + ((si - ph.s0) * steps + st) * 256, 64);
          _tile_dpbf16ps(2, 0, 1);
        }
        _tile_stored(2, c, 64);
        for (int64_t m = 0; m < set.count; ++m) {
          Slot& s = x.slots[set.slot[m]];
          const __mmask16 mask = key_mask(u0, std::max(s.start, u0), std::min(s.len, u0 + kKeys));
          if (!mask) continue;
          const __m512 v = _mm512_i32gather_ps(_mm512_add_epi32(lane16, _mm512_set1_epi32(static_cast<int>(m))), c, 4);
          _mm512_mask_storeu_ps(s.scores.data() + set.hq[m] * s.n + (u0 - s.start), mask, _mm512_mul_ps(v, vscale));
        }
      }
    }
  }
}

// P . V of a phase's row sets, accumulated onto their slots' acc.
inline void pv(const Paged<at::BFloat16>& pg, Scratch& x, const Phase& ph) {
  const int64_t D = pg.D, bs = pg.bs, ref = ph.ref, j0 = ph.j0, j1 = ph.j1, lo = ph.lo, hi = ph.hi;
  const __m512i interleave = pagedserve_amx::pair_interleave();  // two keys' values of a feature as a pair
  alignas(64) uint16_t a[kRows * kKeys];      // P: [rows][16 keys] bf16
  alignas(64) uint16_t vb[4 * 8 * 32];        // V: [4 tiles][8 key pairs][16 features x 2]
  x.acc.resize(kRows * D);
  for (int64_t si = ph.s0; si < ph.s1; ++si) {
    const RowSet& set = x.sets[si];
    std::memset(a, 0, sizeof(a));
    for (int64_t m = 0; m < set.count; ++m)
      std::memcpy(x.acc.data() + m * D, x.slots[set.slot[m]].acc.data() + set.hq[m] * D, D * sizeof(float));
    for (int64_t f0 = 0; f0 < D; f0 += 64) {
      const int64_t nt = std::min<int64_t>(4, (D - f0) / 16);
      // the accumulators of 64 features (C tiles 3 .. 3 + nt)
      _tile_loadd(3, x.acc.data() + f0, D * 4);
      _tile_loadd(4, x.acc.data() + f0 + 16, D * 4);
      if (nt > 2) {
        _tile_loadd(5, x.acc.data() + f0 + 32, D * 4);
        _tile_loadd(6, x.acc.data() + f0 + 48, D * 4);
      }
      for (int64_t j = j0; j <= j1; ++j) {
        const at::BFloat16* blk = pg.vp + pg.block(x.slots[ref].b, j) * pg.block_stride;
        const at::BFloat16* next = j < j1 ? pg.vp + pg.block(x.slots[ref].b, j + 1) * pg.block_stride : nullptr;
        for (int64_t u0 = std::max(j * bs, lo / kKeys * kKeys); u0 < std::min((j + 1) * bs, hi); u0 += kKeys) {
          for (int64_t m = 0; m < set.count; ++m) {
            const Slot& s = x.slots[set.slot[m]];
            const __mmask16 mask = key_mask(u0, std::max(s.start, u0), std::min(s.len, u0 + kKeys));
            const __m512 p = _mm512_maskz_loadu_ps(mask, s.scores.data() + set.hq[m] * s.n + (u0 - s.start));
            _mm256_store_si256(reinterpret_cast<__m256i*>(a + m * kKeys), (__m256i)_mm512_cvtneps_pbh(p));
          }
          const at::BFloat16* rows = blk + (u0 - j * bs) * pg.row_stride + set.h * D + f0;
          for (int64_t r = 0; r < 8; ++r) {
            const int64_t t = u0 + 2 * r;
            if (next)  // the same rows of the next block, a pair at a time
              prefetch(next + (u0 - j * bs + 2 * r) * pg.row_stride + set.h * D + f0, nt * 32),
              prefetch(next + (u0 - j * bs + 2 * r + 1) * pg.row_stride + set.h * D + f0, nt * 32);
            for (int64_t c = 0; c < nt; ++c) {
              const __m256i va = t < hi ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rows + 2 * r * pg.row_stride + 16 * c))
                                        : _mm256_setzero_si256();
              const __m256i vbv = t + 1 < hi ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rows + (2 * r + 1) * pg.row_stride + 16 * c))
                                             : _mm256_setzero_si256();
              const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(va), vbv, 1);
              _mm512_store_si512(vb + (c * 8 + r) * 32, _mm512_permutexvar_epi16(interleave, both));
            }
          }
          _tile_loadd(0, a, 32);
          _tile_loadd(1, vb, 64);
          _tile_dpbf16ps(3, 0, 1);
          _tile_loadd(2, vb + 8 * 32, 64);
          _tile_dpbf16ps(4, 0, 2);
          if (nt > 2) {
            _tile_loadd(1, vb + 2 * 8 * 32, 64);
            _tile_dpbf16ps(5, 0, 1);
            _tile_loadd(2, vb + 3 * 8 * 32, 64);
            _tile_dpbf16ps(6, 0, 2);
          }
        }
      }
      _tile_stored(3, x.acc.data() + f0, D * 4);
      _tile_stored(4, x.acc.data() + f0 + 16, D * 4);
      if (nt > 2) {
        _tile_stored(5, x.acc.data() + f0 + 32, D * 4);
        _tile_stored(6, x.acc.data() + f0 + 48, D * 4);
      }
    }
    for (int64_t m = 0; m < set.count; ++m)
      std::memcpy(x.slots[set.slot[m]].acc.data() + set.hq[m] * D, x.acc.data() + m * D, D * sizeof(float));
  }
}

}  // namespace decode_amx

// Whether decode_bf16_amx serves these shapes (its tiles take 16 keys and 32 features a step).
inline bool decode_amx_shapes(int64_t D, int64_t bs) { return D % 32 == 0 && D <= 256 && bs % 16 == 0; }

void decode_bf16_amx(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                     const at::Tensor& block_tables, const at::Tensor& seq_lens, at::Tensor& out, double scale,
                     int64_t window, bool group, int64_t threads) {
  using decode_amx::Scratch;
  const Paged<at::BFloat16> pg(q, k_cache, v_cache, block_tables, seq_lens, out);
  const int64_t Hq = pg.Hq;
  const SharingOrder seqs = sharing_order(pg, window, group);
  auto task = [&](int64_t begin, int64_t end, Scratch& x) {
    seqs.for_each_run(begin, end, [&](const int64_t* run, int64_t count) {
      const int64_t live = pg.begin_slots(run, count, window, x.slots);
      decode_amx::plan_phases(pg, x, live, pg.shared_entries(x.slots.data(), live));
      // 1. scores: the shared blocks for every slot's rows at once, then each slot's own blocks
      decode_amx::scores_tiles();
      for (const decode_amx::Phase& ph : x.phases) decode_amx::scores(pg, x, ph, static_cast<float>(scale));
      // 2. softmax
      for (int64_t k = 0; k < live; ++k)
        for (int64_t hq = 0; hq < Hq; ++hq)
          x.slots[k].inv[hq] = 1.0f / exp_shifted(x.slots[k].scores.data() + hq * x.slots[k].n, x.slots[k].n);
      // 3. P . V in the same phases
      decode_amx::pv_tiles();
      for (const decode_amx::Phase& ph : x.phases) decode_amx::pv(pg, x, ph);
      _tile_release();
      for (int64_t k = 0; k < live; ++k) pg.store(x.slots[k].b, x.slots[k].acc.data(), x.slots[k].inv.data());
    });
  };
  run_units<Scratch>(seqs, threads, task);
}
#endif
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

// The next block is prefetched a slice of whole cache lines at a time, one slice per unit of
// work on the current block: all of its lines at once (192 for SmolLM2's 12 KB fp32 blocks) ran
// out of the core's miss buffers and left the loads waiting on memory (Zen 3, 16 sequences x 300
// tokens over 30 layers of blocks at random places, one thread: 48-53 -> 29-32 ms).
inline int64_t slice_bytes(int64_t bytes, int64_t parts) { return (bytes + 64 * parts - 1) / (64 * parts) * 64; }

inline bool f32_avx2_head_dim(int64_t D) { return D % 16 == 0 && (D <= 128 || D == 256); }

void decode_f32_avx2(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                     const at::Tensor& block_tables, const at::Tensor& seq_lens, at::Tensor& out, double scale,
                     int64_t window, bool group, int64_t threads) {
  using T = float;
  const Paged<T> pg(q, k_cache, v_cache, block_tables, seq_lens, out);
  struct Kern {
    const Paged<T>& pg;
    float fscale;
    void begin(Slot& s) const { pg.scaled_query(s.b, fscale, s.qf); }
    void scores(Slot& s, int64_t j, const T* blk, const T* next) const {
      const int64_t Hq = pg.Hq, D = pg.D, G = pg.G, bs = pg.bs, row_stride = pg.row_stride;
      const int64_t n = s.n, start = s.start;
      const auto [t0, t1] = s.keys(j, bs);
      // the next block's lines a slice per (8 keys, query head) as the block is worked through
      const int64_t parts = ((t1 - t0 + 7) / 8) * Hq, slice = slice_bytes(pg.block_stride * sizeof(T), parts);
      int64_t part = 0;
      for (int64_t c0 = t0; c0 < t1; c0 += 8) {
        const int64_t count = std::min<int64_t>(t1 - c0, 8);
        const T* rows = blk + (c0 - j * bs) * row_stride;
        for (int64_t hq = 0; hq < Hq; ++hq, ++part) {
          if (next) prefetch(reinterpret_cast<const char*>(next) + part * slice, slice);
          const float* qh = s.qf.data() + hq * D;
          const T* kh = rows + (hq / G) * D;
          __m256 sv;
          switch (D / 8) {
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
          std::memcpy(s.scores.data() + hq * n + (c0 - start), lane, count * sizeof(float));
        }
      }
    }
    void pv(Slot& s, int64_t j, const T* blk, const T* next) const {
      const int64_t D = pg.D, G = pg.G, bs = pg.bs, Hkv = pg.Hkv, row_stride = pg.row_stride;
      const int64_t n = s.n, start = s.start;
      const auto [t0, t1] = s.keys(j, bs);
      const T* rows = blk + (t0 - j * bs) * row_stride;
      const int64_t parts = Hkv * ((G + 3) / 4) * (D / 16), slice = slice_bytes(pg.block_stride * sizeof(T), parts);
      int64_t part = 0;
      for (int64_t h = 0; h < Hkv; ++h)
        for (int64_t g0 = 0; g0 < G; g0 += 4) {
          const int64_t gn = std::min<int64_t>(4, G - g0);
          const float* p = s.scores.data() + (h * G + g0) * n + (t0 - start);
          for (int64_t c = 0; c < D; c += 16, ++part) {
            if (next) prefetch(reinterpret_cast<const char*>(next) + part * slice, slice);
            float* a = s.acc.data() + (h * G + g0) * D + c;
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
  };
  visit_sequences(pg, window, group, threads, Kern{pg, static_cast<float>(scale)});
}
#endif

// bf16 decode on AMX tiles where available (set_decode_amx)
std::atomic<bool> g_decode_amx{true};

}  // namespace

void set_decode_amx(bool on) { g_decode_amx.store(on, std::memory_order_relaxed); }

// whether bf16 paged_decode runs on AMX tiles here (built for AMX-BF16, the OS granted them, and on)
bool decode_amx_available() {
#if defined(PAGEDSERVE_DECODE_AMX)
  return g_decode_amx.load(std::memory_order_relaxed) && blocks_amx_available();
#else
  return false;
#endif
}

at::Tensor paged_decode(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                        const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale,
                        int64_t window, bool share_blocks, int64_t threads) {
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
        decode_f32_avx2(q, k_cache, v_cache, block_tables, seq_lens, out, scale, window, share_blocks, threads);
        break;
      }
#endif
      decode<float>(q, k_cache, v_cache, block_tables, seq_lens, out, scale, window, share_blocks, threads);
      break;
    case at::kBFloat16:
#if defined(PAGEDSERVE_DECODE_AMX)
      if (decode_amx_available() && decode_amx_shapes(q.size(2), k_cache.size(1))) {
        decode_bf16_amx(q, k_cache, v_cache, block_tables, seq_lens, out, scale, window, share_blocks, threads);
        break;
      }
#endif
#if defined(__AVX512BF16__)
      if (bf16_dot_head_dim(q.size(2))) {
        decode_bf16(q, k_cache, v_cache, block_tables, seq_lens, out, scale, window, share_blocks, threads);
        break;
      }
#endif
      decode<at::BFloat16>(q, k_cache, v_cache, block_tables, seq_lens, out, scale, window, share_blocks, threads);
      break;
    case at::kHalf:
      decode<at::Half>(q, k_cache, v_cache, block_tables, seq_lens, out, scale, window, share_blocks, threads);
      break;
    default:
      TORCH_CHECK(false, "paged_decode: unsupported dtype ", q.scalar_type());
  }
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode, "paged decode attention over KV read in place (CPU); share_blocks: "
        "sequences with leading blocks in common read them once; threads: its thread count (<= 0: torch's)");
  m.def("set_decode_amx", &set_decode_amx, "bf16 paged_decode on AMX tiles where available (on by default)");
  m.def("decode_amx_available", &decode_amx_available, "whether bf16 paged_decode runs on AMX tiles (built, "
        "granted by the OS, and on; block sizes a multiple of 16, head dims of 32 a step)");
  m.def("llama_layers", &llama_layers, "a step's Llama decoder layers (bf16; GGUF block records or oneDNN's "
        "prepacked weights) in one call; returns the final norm's (hidden, residual)");
  m.def("rms_norm", &rms_norm, "Llama RMSNorm of each row");
  m.def("fused_add_rms_norm", &fused_add_rms_norm, "residual += x; x = RMSNorm(residual), in place");
  m.def("rotary_neox", &rotary_neox, "NeoX rotary embedding of query and key, in place");
  m.def("silu_and_mul", &silu_and_mul, "silu(x[:, :d]) * x[:, d:]");
  m.def("argmax_rows", &argmax_rows, "each fp32 row's argmax, as torch.argmax(dim=-1)");
  m.def("sample_rows", &sample_rows, "each fp32 row's token drawn from softmax(x / temperature) at its "
        "uniform (the inverse CDF); -1 where the row's max is not finite");
  m.def("write_kv", &write_kv, "store K/V rows at their slots of the paged pools");
  m.def("prefill_bf16_available", &prefill_bf16_available, "whether the AVX512-BF16 prefill attention was built");
  m.def("prefill_amx_available", &prefill_amx_available, "whether paged_prefill can run on AMX tiles (built and "
        "granted)");
  m.def("paged_prefill", &paged_prefill, "one sequence's prefill chunk attending to its paged KV (bf16); use_amx: "
        "on AMX tiles where available (head dims up to 128)");
  m.def("gemm_available", &gemm_available, "whether the AVX2 fp32 linear kernel was built");
  m.def("gemm_bf16_available", &gemm_bf16_available, "whether the AVX512-BF16 bf16 linear kernel was built");
  m.def("pack_linear", &pack_linear, "a weight [N, K] packed into panels (fp32: 16 features, bf16: 32 x 2 k)");
  m.def("linear_packed", &linear_packed, "x W^T + b with W packed by pack_linear (fp32 AVX2, bf16 AVX512-BF16)");
  m.def("set_decode_pool", &set_decode_pool, "helper threads for decode steps' linears and attention: "
        "helpers beside the caller, spinning spin_us after each region (0 helpers: torch's threads)");
  m.def("decode_pool_helpers", &decode_pool_helpers, "the decode pool's helper threads");
  m.def("linear_blocks", &linear_blocks, "x W^T + b with W in GGUF Q4_1 / Q8_0 blocks of 16-feature panels (fp32 AVX2)");
  m.def("blocks_bf16_available", &blocks_bf16_available, "whether the AVX512-BF16 GGUF-block kernel was built");
  m.def("blocks_amx_available", &blocks_amx_available, "whether linear_blocks_bf16 runs on AMX tiles (built and "
        "granted by the OS)");
  m.def("linear_blocks_bf16", &linear_blocks_bf16, "x W^T + b for bf16 x with W in GGUF Q4_1 / Q8_0 block "
        "records of 16-feature panels (AMX tiles where available and use_amx, else AVX512-BF16)");
  m.def("linear_onednn_split", &linear_onednn_split, "x W^T + b with W prepacked for oneDNN in parts of output "
        "features [starts[i], starts[i + 1]), the parts on the decode pool's threads");
}
