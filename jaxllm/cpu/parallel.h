// One call's work spread over XLA's intra-op thread pool, for the native CPU kernels
// (linear.cc, attention.cc, quant_linear.cc, quant_dot.cc).  Header-only; native.py hashes
// it with each source it builds.
#pragma once

#include <immintrin.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>
#include <utility>

#include "xla/ffi/api/ffi.h"

namespace jaxllm_parallel {

// ---- The relay: helpers that stay hot between calls ----
//
// A batch-1 decode step calls the kernels ~200 times, 5-40 us each (the built-in model's
// projections are 0.2-1 MB of weights), and schedules a pool task for each.  In a quiet
// decode step the Q4_1 projections read their weights at about one core's rate (13.5 GB/s
// against ~12 for the kernel's loop on one core), while one long call (the LM head) reaches
// two cores' (26 GB/s): the likely cause is the helper's start, waking the pool's other
// thread (on a VM an IPI to an idle vCPU), which takes about as long as a short call, so the
// caller has claimed most items before the helper comes.  So a helper task, once its call's items
// are done, lingers (spinning) on the relay, where the next call (of any of the
// kernel libraries: native.py hands every library the same relay) posts its job instead of
// scheduling a task; after the linger time without a job it returns to the pool.
//
// The linger time is 0 (off) unless set (jaxllm_parallel_set_linger_us, native.py's
// set_linger_us): whether it pays, and how long, is for a quiet machine to measure
// (bench/q4_1_linear.py --linger-us alternates it within one process); on a machine loaded
// several times over its cores, the only kind this was built on, it measured within noise.
// Nothing waits on the relay: a job posted and not taken (the helper just left) is done by
// its caller, which claims every item it can (see for_each_item), and withdrawn.
constexpr int kSpins = 256;   // pauses (~10 us) before a lingering helper starts yielding

struct Job {
  virtual void work() = 0;
  virtual ~Job() = default;
};

struct Relay {
  std::mutex mu;
  std::shared_ptr<Job> posted;   // the job idle helpers take, takers of them at most
  int takers = 0;
  int idle = 0;                  // helpers lingering
  std::atomic<bool> has_post{false};   // read without the lock by the spinning helpers
  std::atomic<int64_t> linger_us{0};   // how long a helper waits for a next job (0: not at all)
  std::atomic<int64_t> relayed{0};     // jobs lingering helpers took (tests, benchmarks)
};

// This library's relay: its own until native.py hands it the first library's
// (jaxllm_parallel_relay below), so that a helper lingering after a matmul serves the
// attention call that follows.
// (Never destroyed: a helper may still linger on it while the process exits.)
inline Relay*& relay_slot() {
  static Relay* used = new Relay;
  return used;
}

// Posts `job` for up to `helpers` lingering helpers; how many it was posted for (0: none idle,
// or another call's job is still posted).
inline int post(const std::shared_ptr<Job>& job, int64_t helpers) {
  Relay& r = *relay_slot();
  std::lock_guard<std::mutex> g(r.mu);
  if (r.idle == 0 || r.posted) return 0;
  r.posted = job;
  r.takers = static_cast<int>(std::min<int64_t>(r.idle, helpers));
  r.has_post.store(true, std::memory_order_release);
  return r.takers;
}

// Withdraws `job` if no helper took it (its caller has done all its items).
inline void withdraw(const std::shared_ptr<Job>& job) {
  Relay& r = *relay_slot();
  std::lock_guard<std::mutex> g(r.mu);
  if (r.posted == job) {
    r.posted.reset();
    r.takers = 0;
    r.has_post.store(false, std::memory_order_relaxed);
  }
}

// Takes the posted job for this helper (under the lock); null when there is none.
inline std::shared_ptr<Job> take_locked(Relay& r) {
  if (!r.posted || r.takers == 0) return nullptr;
  std::shared_ptr<Job> job = r.posted;
  r.relayed.fetch_add(1, std::memory_order_relaxed);
  if (--r.takers == 0) {
    r.posted.reset();
    r.has_post.store(false, std::memory_order_relaxed);
  }
  return job;
}

// The rest of a helper task after its first job: run the jobs posted while it lingers.
inline void linger() {
  Relay& r = *relay_slot();
  const auto wait = std::chrono::microseconds(r.linger_us.load(std::memory_order_relaxed));
  if (wait.count() <= 0) return;
  {
    std::lock_guard<std::mutex> g(r.mu);
    ++r.idle;
  }
  auto last = std::chrono::steady_clock::now();
  for (int spins = 0;; ++spins) {
    const bool look = r.has_post.load(std::memory_order_acquire);
    const bool expired = spins % 16 == 0 && std::chrono::steady_clock::now() - last > wait;
    if (look || expired) {
      std::shared_ptr<Job> job;
      {
        std::lock_guard<std::mutex> g(r.mu);
        job = take_locked(r);   // leaving: a job posted for this helper meanwhile runs first
        if (job || expired) --r.idle;
      }
      if (!job && expired) return;
      if (job) {
        job->work();
        job.reset();
        std::lock_guard<std::mutex> g(r.mu);
        ++r.idle;
        last = std::chrono::steady_clock::now();
        spins = 0;
        continue;
      }
    }
    // Spin briefly, then yield between looks: on a loaded machine the core goes to
    // whoever else is runnable (a posted job is done by its caller meanwhile); on a quiet
    // one sched_yield returns at once and this is a spin.
    if (spins < kSpins) _mm_pause();
    else std::this_thread::yield();
  }
}

// Runs body(i, state) for every i in [0, items), on the calling thread and on up to
// `helpers` others: lingering helpers of the relay first, tasks scheduled on the pool for
// the rest; each worker makes its state (scratch) with make_state() before its first item.
// Items are claimed with an atomic counter, so the caller never waits for a helper that has
// not started (it claims the items itself; a helper that comes late finds none), and the
// shared part is reference-counted because a helper may outlive the call.  Every item has
// run when this returns, so body may point into the caller's frame.
template <typename MakeState, typename Body>
void for_each_item(xla::ffi::ThreadPool& pool, int64_t items, int64_t helpers, MakeState make_state, Body body) {
  struct Shared : Job {
    Shared(int64_t n, MakeState m, Body b) : items(n), make_state(std::move(m)), body(std::move(b)) {}
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> done{0};
    const int64_t items;
    MakeState make_state;
    Body body;
    void work() override {
      std::optional<decltype(make_state())> state;
      for (int64_t i; (i = next.fetch_add(1)) < items;) {
        if (!state) state.emplace(make_state());
        body(i, *state);
        done.fetch_add(1, std::memory_order_release);
      }
    }
  };
  auto sh = std::make_shared<Shared>(items, std::move(make_state), std::move(body));
  const int posted = helpers > 0 ? post(sh, helpers) : 0;
  for (int64_t t = posted; t < helpers; ++t) pool.Schedule([sh] {
      sh->work();
      linger();
    });
  sh->work();
  if (posted) withdraw(sh);
  // A helper's item in progress: spin, then let the OS run it (on a loaded machine it may
  // be waiting for this very core).
  for (int spins = 0; sh->done.load(std::memory_order_acquire) < items; ++spins) {
    if (spins < 4096) _mm_pause();
    else std::this_thread::yield();
  }
}

// The same without per-worker state.
template <typename Body>
void for_each_item(xla::ffi::ThreadPool& pool, int64_t items, int64_t helpers, Body body) {
  for_each_item(pool, items, helpers, [] { return 0; }, [body](int64_t i, int&) { body(i); });
}

}  // namespace jaxllm_parallel

// The relay every kernel library of the process shares: `use` (when not null) becomes this
// library's; returns the one in use.  native.py passes the first library's to the others.
// (Not inline: ctypes needs the symbol; each library is one source that includes this once.)
extern "C" void* jaxllm_parallel_relay(void* use) {
  if (use != nullptr) jaxllm_parallel::relay_slot() = static_cast<jaxllm_parallel::Relay*>(use);
  return jaxllm_parallel::relay_slot();
}

// Sets how long (us) a helper lingers for the next call's job, for every library sharing
// this relay (0: off, the default); returns the previous value.
extern "C" int64_t jaxllm_parallel_set_linger_us(int64_t us) {
  return jaxllm_parallel::relay_slot()->linger_us.exchange(us < 0 ? 0 : us);
}

// Jobs lingering helpers have taken so far (every library sharing this relay).
extern "C" int64_t jaxllm_parallel_relayed() { return jaxllm_parallel::relay_slot()->relayed.load(); }
