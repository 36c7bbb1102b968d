// Native CPU matmul for XLA: y[M, N] = x[M, K] . w[N, K]^T, float32 accumulation.
//
// XLA:CPU runs these shapes (small M: decode batches; weights in transformers' [out, in]
// layout) through Eigen at a fraction of what the memory and FMA units allow, and
// upcasts bf16 weights to float32 as a whole before multiplying.  This kernel reads each
// weight row once per M tile, converts bf16 to float32 in registers, and splits the
// output columns over XLA's intra-op thread pool.  Called from jaxllm/cpu/native.py via XLA's FFI.
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// 8 weights from row w at column k, as float32.
inline __m256 load8(const float* w) { return _mm256_loadu_ps(w); }
inline __m256 load8(const uint16_t* w) {
  __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline float to_f32(float v) { return v; }
inline float to_f32(uint16_t v) {
  uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  __builtin_memcpy(&f, &bits, 4);
  return f;
}

inline float hsum(__m256 v) {
  __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
  lo = _mm_add_ps(lo, hi);
  lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
  lo = _mm_add_ss(lo, _mm_shuffle_ps(lo, lo, 1));
  return _mm_cvtss_f32(lo);
}

// One MR x NR output tile: MR*NR dot products of length K, each over 8-wide lanes.
template <int MR, int NR, typename W>
inline void tile(const float* x, const W* w, float* y, int64_t K, int64_t N) {
  __m256 acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    __m256 wv[NR];
    for (int j = 0; j < NR; ++j) wv[j] = load8(w + j * K + k);
    for (int i = 0; i < MR; ++i) {
      __m256 xv = _mm256_loadu_ps(x + i * K + k);
      for (int j = 0; j < NR; ++j) acc[i][j] = _mm256_fmadd_ps(xv, wv[j], acc[i][j]);
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) {
      float s = hsum(acc[i][j]);
      for (int64_t kk = k; kk < K; ++kk) s += x[i * K + kk] * to_f32(w[j * K + kk]);
      y[i * N + j] = s;
    }
}

template <int MR, typename W>
inline void row_block(const float* x, const W* w, float* y, int64_t K, int64_t N, int64_t n0, int64_t n1) {
  // NR = 4 columns at a time for narrow M (memory bound: more loads in flight), 3 otherwise
  // (MR * NR accumulators + NR weight vectors + 1 activation vector fit in 16 registers).
  constexpr int NR = MR <= 2 ? 4 : 3;
  int64_t n = n0;
  for (; n + NR <= n1; n += NR) tile<MR, NR>(x, w + n * K, y + n, K, N);
  for (; n < n1; ++n) tile<MR, 1>(x, w + n * K, y + n, K, N);
}

// Output columns [n0, n1) of y: each panel of weight rows is multiplied against every
// 4-row block of x while it is in L1, so a weight row is read from memory once per call.
template <typename W>
void linear_columns(const float* x, const W* w, float* y, int64_t M, int64_t K, int64_t N, int64_t n0,
                    int64_t n1) {
  constexpr int64_t kPanel = 48;
  for (int64_t p = n0; p < n1; p += kPanel) {
    const int64_t pe = std::min(n1, p + kPanel);
    int64_t m = 0;
    for (; m + 4 <= M; m += 4) row_block<4>(x + m * K, w, y + m * N, K, N, p, pe);
    switch (M - m) {
      case 3: row_block<3>(x + m * K, w, y + m * N, K, N, p, pe); break;
      case 2: row_block<2>(x + m * K, w, y + m * N, K, N, p, pe); break;
      case 1: row_block<1>(x + m * K, w, y + m * N, K, N, p, pe); break;
      default: break;
    }
  }
}

// Work shared between the calling thread and XLA's intra-op pool.  Parts (column ranges)
// are claimed with an atomic counter, so the caller never waits for a task that has not
// started (it claims the parts itself; a task that starts late finds none and returns),
// and the state is reference-counted because such a task may outlive the call.
struct Shared {
  std::atomic<int> next{0};
  std::atomic<int> done{0};
  int parts = 0;
  std::function<void(int)> run;
  void work() {
    for (int i; (i = next.fetch_add(1)) < parts;) {
      run(i);
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

template <typename W>
void linear(ffi::ThreadPool& pool, const float* x, const W* w, float* y, int64_t M, int64_t K, int64_t N) {
  // XLA:CPU's own workers would spin against a separate OpenMP team on the same cores
  // (measured: two OpenMP threads were no faster than one inside a step), so the columns
  // are split over XLA's intra-op pool instead.
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  const int parts = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(2 * threads, N / 96)));
  if (parts == 1) {
    linear_columns(x, w, y, M, K, N, 0, N);
    return;
  }
  const int64_t chunk = ((N + parts - 1) / parts + 11) / 12 * 12;
  auto sh = std::make_shared<Shared>();
  sh->parts = parts;
  sh->run = [=](int i) {
    const int64_t n0 = std::min<int64_t>(N, i * chunk), n1 = std::min<int64_t>(N, n0 + chunk);
    linear_columns(x, w, y, M, K, N, n0, n1);
  };
  for (int64_t t = 0; t < std::min<int64_t>(threads, parts - 1); ++t) pool.Schedule([sh] { sh->work(); });
  sh->work();
  while (sh->done.load(std::memory_order_acquire) < parts) _mm_pause();
}

template <ffi::DataType WT>
ffi::Error LinearImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<WT> w, ffi::ResultBuffer<ffi::F32> y) {
  auto xd = x.dimensions();
  auto wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2 || xd[1] != wd[1])
    return ffi::Error::InvalidArgument("jaxllm_linear: expected x[M, K] and w[N, K]");
  const int64_t M = xd[0], K = xd[1], N = wd[0];
  // U16 weights are bfloat16 bit patterns (see native.py).
  using W = std::conditional_t<WT == ffi::DataType::F32, float, uint16_t>;
  linear<W>(pool, x.typed_data(), reinterpret_cast<const W*>(w.untyped_data()), y->typed_data(), M, K, N);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxllmLinearF32, LinearImpl<ffi::DataType::F32>,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxllmLinearBF16, LinearImpl<ffi::DataType::U16>,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U16>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
