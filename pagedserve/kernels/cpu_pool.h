// Helper threads for the short parallel regions of a CPU decode step (the linears and the decode
// attention of cpu_gemm.cpp and cpu_decode.cpp).
//
// An OpenMP region ends at a barrier that every thread of the team must reach, the ones that
// never got a core during the region included: served on 2 cores, where the second core is the
// HTTP stack's too, a decode linear of ~0.5 ms on two threads waited for the thread on the busy
// core, and decode on both cores was slower than on one. Here the caller and the helpers take
// units of work from one counter; the caller runs units until none is left and then waits only
// for the units a helper has already taken. A helper that has not woken yet takes nothing, so the
// caller never waits for one to be scheduled: at worst it runs every unit itself, as on one
// thread. Helpers spin a little after each region (a decode step's regions follow each other
// within tens of microseconds) and then sleep on a futex.
//
// Results do not depend on which thread runs a unit (units write disjoint outputs).
#pragma once

#if defined(__x86_64__)
#include <immintrin.h>
#endif
#include <ATen/Parallel.h>
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <climits>
#include <cstdint>
#include <thread>
#include <vector>

namespace pagedserve_pool {

inline void cpu_relax() {
#if defined(__x86_64__)
  _mm_pause();
#else
  std::this_thread::yield();
#endif
}

class Pool {
 public:
  static Pool& get() {
    static Pool* pool = new Pool();  // never destroyed: helpers may still sleep at exit
    return *pool;
  }

  // `helpers` threads beside the caller's (0: none, every region runs on the caller), which spin
  // `spin_us` microseconds after a region before they sleep.
  void configure(int helpers, int spin_us) {
    helpers = std::max(0, std::min(helpers, 63));
    spin_us_.store(std::max(0, spin_us), std::memory_order_relaxed);
    if (helpers == static_cast<int>(threads_.size())) return;
    stop_threads();
    stop_.store(false);
    for (int i = 0; i < helpers; ++i) threads_.emplace_back([this, i] { helper(i + 1); });
  }

  int helpers() const { return static_cast<int>(threads_.size()); }

  // fn(unit, worker) for every 0 <= unit < units, worker 0 the caller, 1.. the helpers; returns
  // when all have run. Serial where there are no helpers, one unit, or another thread is inside
  // a region already.
  template <typename F>
  void run(int64_t units, const F& fn) {
    if (units <= 0) return;
    if (threads_.empty() || units == 1 || units > kMaxUnits || busy_.exchange(true, std::memory_order_acquire)) {
      for (int64_t u = 0; u < units; ++u) fn(u, 0);
      return;
    }
    ctx_ = &fn;
    call_ = [](const void* ctx, int64_t unit, int worker) { (*static_cast<const F*>(ctx))(unit, worker); };
    done_.store(0, std::memory_order_relaxed);
    job_ = (job_ + 1) & kJobMask;
    claim_.store(pack(job_, units, 0), std::memory_order_release);
    seq_.store(job_, std::memory_order_seq_cst);
    if (sleepers_.load(std::memory_order_seq_cst) > 0)
      syscall(SYS_futex, reinterpret_cast<uint32_t*>(&seq_), FUTEX_WAKE_PRIVATE, INT_MAX, nullptr, nullptr, 0);
    const int64_t mine = work(job_, 0);
    while (done_.load(std::memory_order_acquire) != units - mine) cpu_relax();
    busy_.store(false, std::memory_order_release);
  }

 private:
  // claim_: job (24 bits) | units (20) | next unit (20)
  static constexpr uint64_t kJobMask = (1u << 24) - 1, kUnitMask = (1u << 20) - 1;
  static constexpr int64_t kMaxUnits = static_cast<int64_t>(kUnitMask);
  static uint64_t pack(uint64_t job, uint64_t units, uint64_t next) { return job << 40 | units << 20 | next; }

  Pool() = default;

  // Runs units of `job` while any is left; returns how many it ran. A unit is claimed by advancing
  // the counter of its own job, so a thread holding a stale job's counter never claims one; the
  // region (ctx_, call_) it then reads stays put until the caller has seen that unit done.
  int64_t work(uint64_t job, int worker) {
    int64_t ran = 0;
    uint64_t c = claim_.load(std::memory_order_acquire);
    while ((c >> 40) == job && (c & kUnitMask) < ((c >> 20) & kUnitMask)) {
      if (!claim_.compare_exchange_weak(c, c + 1, std::memory_order_acq_rel, std::memory_order_acquire)) continue;
      call_(ctx_, static_cast<int64_t>(c & kUnitMask), worker);
      ++ran;
      if (worker != 0) done_.fetch_add(1, std::memory_order_release);
      c = claim_.load(std::memory_order_acquire);
    }
    return ran;
  }

  void helper(int worker) {
    uint32_t seen = seq_.load(std::memory_order_acquire);
    while (!stop_.load(std::memory_order_acquire)) {
      uint32_t s = seq_.load(std::memory_order_acquire);
      if (s != seen) {
        seen = s;
        work(s, worker);
        continue;
      }
      const auto until =
          std::chrono::steady_clock::now() + std::chrono::microseconds(spin_us_.load(std::memory_order_relaxed));
      bool moved = false;
      while (!moved && std::chrono::steady_clock::now() < until)
        for (int i = 0; i < 64 && !moved; ++i) {
          cpu_relax();
          moved = seq_.load(std::memory_order_relaxed) != seen || stop_.load(std::memory_order_relaxed);
        }
      if (moved) continue;
      sleepers_.fetch_add(1, std::memory_order_seq_cst);
      if (seq_.load(std::memory_order_seq_cst) == seen && !stop_.load(std::memory_order_seq_cst))
        syscall(SYS_futex, reinterpret_cast<uint32_t*>(&seq_), FUTEX_WAIT_PRIVATE, seen, nullptr, nullptr, 0);
      sleepers_.fetch_sub(1, std::memory_order_seq_cst);
    }
  }

  void stop_threads() {
    stop_.store(true, std::memory_order_seq_cst);
    seq_.fetch_add(0x1000000u, std::memory_order_seq_cst);  // beyond any job: wakes, claims nothing
    syscall(SYS_futex, reinterpret_cast<uint32_t*>(&seq_), FUTEX_WAKE_PRIVATE, INT_MAX, nullptr, nullptr, 0);
    for (auto& t : threads_) t.join();
    threads_.clear();
  }

  alignas(64) std::atomic<uint64_t> claim_{0};
  alignas(64) std::atomic<int64_t> done_{0};
  alignas(64) std::atomic<uint32_t> seq_{0};  // the futex word: the latest job
  std::atomic<int> sleepers_{0};
  std::atomic<bool> stop_{false};
  std::atomic<bool> busy_{false};
  std::atomic<int> spin_us_{50};
  const void* ctx_ = nullptr;
  void (*call_)(const void*, int64_t, int) = nullptr;
  uint64_t job_ = 0;
  std::vector<std::thread> threads_;
  static_assert(sizeof(std::atomic<uint32_t>) == sizeof(uint32_t), "futex word");
};

// fn(begin, end) over [0, n) in pieces of `grain` on the pool's threads.
template <typename F>
void pool_for(int64_t n, int64_t grain, const F& fn) {
  grain = std::max<int64_t>(1, grain);
  const int64_t units = (n + grain - 1) / grain;
  Pool::get().run(units, [&](int64_t u, int) { fn(u * grain, std::min(n, (u + 1) * grain)); });
}

// The panels of a decode linear over threads: the pool's where it has helpers, in units of `unit`
// panels; else torch's threads, in chunks of at least `grain`.
template <typename F>
void decode_for(int64_t panels, int64_t grain, int64_t unit, const F& fn) {
  if (Pool::get().helpers() > 0)
    pool_for(panels, unit, fn);
  else
    at::parallel_for(0, panels, grain, fn);
}

// fn(begin, end) over [0, n) in pieces of `grain`: on the pool's threads where it has helpers and
// the step runs on one torch thread (served: every step, prefill chunks included, so that no
// region waits at a barrier for a thread whose core the HTTP stack holds), else torch's threads.
template <typename F>
void rows_for(int64_t n, int64_t grain, const F& fn) {
  if (n > grain && Pool::get().helpers() > 0 && at::get_num_threads() == 1 && !at::in_parallel_region())
    pool_for(n, grain, fn);
  else
    at::parallel_for(0, n, grain, fn);
}

}  // namespace pagedserve_pool
