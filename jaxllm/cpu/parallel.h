// One call's work spread over XLA's intra-op thread pool, for the native CPU kernels
// (linear.cc, attention.cc).  Header-only; native.py hashes it with each source it builds.
#pragma once

#include <immintrin.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <utility>

#include "xla/ffi/api/ffi.h"

namespace jaxllm_parallel {

// Runs body(i, state) for every i in [0, items), on the calling thread and on `helpers`
// tasks of the pool; each worker makes its state (scratch) with make_state() before its
// first item.  Items are claimed with an atomic counter, so the caller never waits for a
// task that has not started (it claims the items itself; a task that starts late finds
// none and returns), and the shared part is reference-counted because such a task may
// outlive the call.  Every item has run when this returns, so body may point into the
// caller's frame.
template <typename MakeState, typename Body>
void for_each_item(xla::ffi::ThreadPool& pool, int64_t items, int64_t helpers, MakeState make_state, Body body) {
  struct Shared {
    Shared(int64_t n, MakeState m, Body b) : items(n), make_state(std::move(m)), body(std::move(b)) {}
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> done{0};
    const int64_t items;
    MakeState make_state;
    Body body;
    void work() {
      std::optional<decltype(make_state())> state;
      for (int64_t i; (i = next.fetch_add(1)) < items;) {
        if (!state) state.emplace(make_state());
        body(i, *state);
        done.fetch_add(1, std::memory_order_release);
      }
    }
  };
  auto sh = std::make_shared<Shared>(items, std::move(make_state), std::move(body));
  for (int64_t t = 0; t < helpers; ++t) pool.Schedule([sh] { sh->work(); });
  sh->work();
  while (sh->done.load(std::memory_order_acquire) < items) _mm_pause();
}

// The same without per-worker state.
template <typename Body>
void for_each_item(xla::ffi::ThreadPool& pool, int64_t items, int64_t helpers, Body body) {
  for_each_item(pool, items, helpers, [] { return 0; }, [body](int64_t i, int&) { body(i); });
}

}  // namespace jaxllm_parallel
