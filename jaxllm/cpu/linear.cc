// Native CPU matmul for XLA: y[M, N] = x[M, K] . w[N, K]^T, float32 accumulation.
//
// XLA:CPU runs these shapes (small M: decode batches; weights in transformers' [out, in]
// layout) through Eigen at a fraction of what the memory and FMA units allow, and
// upcasts bf16 weights to float32 as a whole before multiplying.  This kernel reads each
// weight row from memory once per call, converts bf16 to float32 in registers, and splits
// the output columns over XLA's intra-op thread pool.  Called from jaxllm/cpu/native.py via XLA's FFI.
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <type_traits>
#include <vector>

#include "simd.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using jaxllm_simd::hsum;
using jaxllm_simd::load8;
using jaxllm_simd::to_f32;

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
// 4-row block of x while it is in L1/L2, so a weight row is read from memory once per call.
// bf16 panels are widened to float32 once into a per-thread buffer first: widening in the
// tile would redo it for every block of x (at batch 32, 8 times), and the shifts compete
// with the FMAs for the same vector pipes.
inline void widen(const float* w, float* out, int64_t n) { std::copy(w, w + n, out); }
inline void widen(const uint16_t* w, float* out, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(out + i, load8(w + i));
  for (; i < n; ++i) out[i] = to_f32(w[i]);
}

template <typename W>
void panel_columns(const float* x, const W* w, float* y, int64_t M, int64_t K, int64_t N, int64_t n0,
                   int64_t n1) {
  constexpr int64_t kPanel = 48;
  thread_local std::vector<float> widened;
  for (int64_t p = n0; p < n1; p += kPanel) {
    const int64_t pe = std::min(n1, p + kPanel);
    const float* pw;   // the panel's rows [p, pe) as float32, row n at pw + (n - p) * K
    if constexpr (std::is_same_v<W, float>) {
      pw = w + p * K;
    } else {
      widened.resize(kPanel * K);
      widen(w + p * K, widened.data(), (pe - p) * K);
      pw = widened.data();
    }
    int64_t m = 0;
    for (; m + 4 <= M; m += 4) row_block<4>(x + m * K, pw, y + m * N + p, K, N, 0, pe - p);
    switch (M - m) {
      case 3: row_block<3>(x + m * K, pw, y + m * N + p, K, N, 0, pe - p); break;
      case 2: row_block<2>(x + m * K, pw, y + m * N + p, K, N, 0, pe - p); break;
      case 1: row_block<1>(x + m * K, pw, y + m * N + p, K, N, 0, pe - p); break;
      default: break;
    }
  }
}

// --- Decode-sized M: one weight row at a time, so each thread reads one sequential stream.
//
// Measured on the 2-core dev machine (SmolLM2's 210 layer matrices + its LM head, bf16):
// reading 4 rows side by side (the panel kernel) ran at 12 GB/s with two threads, one row at
// a time at 16.6-17.2 GB/s, the machine's two-thread read bandwidth: four interleaved
// 1 KB streams defeat the hardware prefetcher, one long stream does not.
//
// Weights are consumed 16 at a time as two float32 vectors (a, b).  For bf16 the 16 bits of
// a 32-bit lane hold two consecutive weights, so one shift and one mask yield the even and
// the odd weights as float32 (a: k, k+2, ..., k+14; b: k+1, ..., k+15), one instruction per
// 8 weights where widening costs two; x is permuted once per call to match (see permute_x).
inline void load16(const float* w, __m256& a, __m256& b) {
  a = _mm256_loadu_ps(w);
  b = _mm256_loadu_ps(w + 8);
}
inline void load16(const uint16_t* w, __m256& a, __m256& b) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
  a = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
  b = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

// x [M, K] -> xp [M, K] in the order load16 yields weights: within each full 16-column chunk
// the even columns then the odd ones (bf16); unchanged for float32 and for the K % 16 tail.
template <typename W>
void permute_x(const float* x, float* xp, int64_t M, int64_t K) {
  const int64_t full = K / 16 * 16;
  for (int64_t m = 0; m < M; ++m) {
    const float* xr = x + m * K;
    float* pr = xp + m * K;
    if constexpr (std::is_same_v<W, uint16_t>) {
      for (int64_t k = 0; k < full; k += 16)
        for (int i = 0; i < 8; ++i) {
          pr[k + i] = xr[k + 2 * i];
          pr[k + 8 + i] = xr[k + 2 * i + 1];
        }
    } else {
      std::copy(xr, xr + full, pr);
    }
    std::copy(xr + full, xr + K, pr + full);
  }
}

// y[i, n] for the MR rows of xp and the one weight row wr [K]; U chunks of 16 per iteration
// keep 2 * U * MR independent FMA chains in flight.
template <int MR, int U, typename W>
inline void row_dot(const float* xp, const W* wr, float* y, int64_t K, int64_t N) {
  __m256 acc[MR][2 * U];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < 2 * U; ++j) acc[i][j] = _mm256_setzero_ps();
  const int64_t full = K / 16 * 16;
  int64_t k = 0;
  for (; k + 16 * U <= full; k += 16 * U)
    for (int u = 0; u < U; ++u) {
      __m256 a, b;
      load16(wr + k + 16 * u, a, b);
      for (int i = 0; i < MR; ++i) {
        acc[i][2 * u] = _mm256_fmadd_ps(_mm256_loadu_ps(xp + i * K + k + 16 * u), a, acc[i][2 * u]);
        acc[i][2 * u + 1] = _mm256_fmadd_ps(_mm256_loadu_ps(xp + i * K + k + 16 * u + 8), b, acc[i][2 * u + 1]);
      }
    }
  for (; k < full; k += 16) {
    __m256 a, b;
    load16(wr + k, a, b);
    for (int i = 0; i < MR; ++i) {
      acc[i][0] = _mm256_fmadd_ps(_mm256_loadu_ps(xp + i * K + k), a, acc[i][0]);
      acc[i][1] = _mm256_fmadd_ps(_mm256_loadu_ps(xp + i * K + k + 8), b, acc[i][1]);
    }
  }
  for (int i = 0; i < MR; ++i) {
    for (int j = 1; j < 2 * U; ++j) acc[i][0] = _mm256_add_ps(acc[i][0], acc[i][j]);
    float s = hsum(acc[i][0]);
    for (int64_t kk = full; kk < K; ++kk) s += xp[i * K + kk] * to_f32(wr[kk]);
    y[i * N] = s;
  }
}

// Columns [n0, n1) for every row of xp (M <= kRowsMaxM): each weight row is read from memory
// once and, for M > 4, from L1 again for each further block of 4 rows of x.
template <typename W>
void row_columns(const float* xp, const W* w, float* y, int64_t M, int64_t K, int64_t N, int64_t n0,
                 int64_t n1) {
  for (int64_t n = n0; n < n1; ++n) {
    const W* wr = w + n * K;
    int64_t m = 0;
    for (; m + 4 <= M; m += 4) row_dot<4, 1>(xp + m * K, wr, y + m * N + n, K, N);
    switch (M - m) {
      case 3: row_dot<3, 1>(xp + m * K, wr, y + m * N + n, K, N); break;
      case 2: row_dot<2, 1>(xp + m * K, wr, y + m * N + n, K, N); break;
      case 1: row_dot<1, 2>(xp + m * K, wr, y + m * N + n, K, N); break;
      default: break;
    }
  }
}

// Up to this many rows of x the row kernel wins; past it, reuse of each weight panel across
// many rows of x (panel_columns) matters more than the access pattern.
constexpr int64_t kRowsMaxM = 8;

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
  std::function<void(int64_t, int64_t)> columns;
  // Every part has run before this call returns (a late task finds no part to claim), so
  // the parts may point into this frame.
  std::vector<float> xp;
  if (M <= kRowsMaxM) {
    xp.resize(M * K);
    permute_x<W>(x, xp.data(), M, K);
    const float* xpd = xp.data();
    columns = [=](int64_t n0, int64_t n1) { row_columns(xpd, w, y, M, K, N, n0, n1); };
  } else {
    columns = [=](int64_t n0, int64_t n1) { panel_columns(x, w, y, M, K, N, n0, n1); };
  }
  if (parts == 1) {
    columns(0, N);
    return;
  }
  const int64_t chunk = ((N + parts - 1) / parts + 11) / 12 * 12;
  auto sh = std::make_shared<Shared>();
  sh->parts = parts;
  sh->run = [=](int i) {
    const int64_t n0 = std::min<int64_t>(N, i * chunk), n1 = std::min<int64_t>(N, n0 + chunk);
    if (n0 < n1) columns(n0, n1);
  };
  // The calling thread works too, so threads - 1 tasks fill the pool's cores; one more only
  // queued a wake-up behind them (measured on two cores: a batch-1 step's matmuls 17.0 ms
  // against 21.0 ms with as many tasks as threads).
  const int64_t tasks = std::max<int64_t>(1, std::min<int64_t>(threads - 1, parts - 1));
  for (int64_t t = 0; t < tasks; ++t) pool.Schedule([sh] { sh->work(); });
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
