// Native CPU matmul for XLA: y[M, N] = x[M, K] . w[N, K]^T, float32 accumulation, with w in
// the panel layout written at load time by jaxllm/cpu/layout.py.
//
// XLA:CPU runs these shapes (small M: decode batches; weights in transformers' [out, in]
// layout) through Eigen at a fraction of what the memory and FMA units allow, and
// upcasts bf16 weights to float32 as a whole before multiplying.
//
// The layout (same element count and shape as [N, K]): the first N / 16 * 16 rows are
// panels of 16 output columns, k-major, panel p at w + p * K * 16 and its 16 weights for
// input k contiguous; the remaining N % 16 rows follow in plain row-major order.  Inside a
// float32 panel the 16 weights are columns 16p + 0..15 in order; inside a bf16 panel the
// 32-bit lane i holds column 16p + i in its low half and 16p + 8 + i in its high half, so
// one shift and one mask turn a 32-byte load into the two float32 vectors of the panel.
//
// The kernel is a broadcast micro-kernel: for each k it loads one panel row (16 weights)
// and multiplies it by x[m, k] broadcast, for up to 6 rows of x at once (12 accumulators).
// A panel is read from memory once per call and reused from L1 for every further tile of
// rows; while the first tile of a panel runs, the next panel is prefetched.  The panels are
// split over XLA's intra-op thread pool, each thread streaming one contiguous range.
// Called from jaxllm/cpu/native.py via XLA's FFI.
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "parallel.h"
#include "simd.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using jaxllm_simd::hsum;
using jaxllm_simd::load8;
using jaxllm_simd::to_f32;

constexpr int64_t kPanel = 16;   // output columns per panel (two 8-float vectors)
constexpr int kMaxRows = 6;      // rows of x per tile: 12 accumulators + 2 weights + 1 broadcast
// Rows of x per block: a block is reused by every panel, so it should stay in L2 (256 KB
// of the 512 KB per core here) while the panels stream through L1.
constexpr int64_t kBlockBytes = 256 * 1024;

// The 16 weights of one panel row as two float32 vectors: columns 0..7 and 8..15.
inline void panel_row(const float* p, __m256& lo, __m256& hi) {
  lo = _mm256_loadu_ps(p);
  hi = _mm256_loadu_ps(p + 8);
}
inline void panel_row(const uint16_t* p, __m256& lo, __m256& hi) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  lo = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
  hi = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

// y[0:MR, 0:16] = x[0:MR, :] . panel, x rows K apart, y rows N apart.  U > 1 interleaves U
// steps of k over separate accumulators, so narrow tiles still keep 8 FMA chains in flight
// (two FMA pipes times four cycles of latency).  ``next``: the following panel's first byte,
// prefetched in step with this one's reads (nullptr: none).
template <int MR, int U, typename W>
inline void micro(const float* x, int64_t K, const W* panel, float* y, int64_t N, const char* next) {
  __m256 acc[U][MR][2];
#pragma GCC unroll 8
  for (int u = 0; u < U; ++u)
#pragma GCC unroll 8
    for (int m = 0; m < MR; ++m) acc[u][m][0] = acc[u][m][1] = _mm256_setzero_ps();
  constexpr int64_t kRowBytes = kPanel * sizeof(W);
  int64_t k = 0;
  for (; k + U <= K; k += U) {
#pragma GCC unroll 8
    for (int u = 0; u < U; ++u) {
      if (next) _mm_prefetch(next + (k + u) * kRowBytes, _MM_HINT_T0);
      __m256 lo, hi;
      panel_row(panel + (k + u) * kPanel, lo, hi);
#pragma GCC unroll 8
      for (int m = 0; m < MR; ++m) {
        const __m256 xb = _mm256_broadcast_ss(x + m * K + k + u);
        acc[u][m][0] = _mm256_fmadd_ps(xb, lo, acc[u][m][0]);
        acc[u][m][1] = _mm256_fmadd_ps(xb, hi, acc[u][m][1]);
      }
    }
  }
  for (; k < K; ++k) {
    __m256 lo, hi;
    panel_row(panel + k * kPanel, lo, hi);
#pragma GCC unroll 8
    for (int m = 0; m < MR; ++m) {
      const __m256 xb = _mm256_broadcast_ss(x + m * K + k);
      acc[0][m][0] = _mm256_fmadd_ps(xb, lo, acc[0][m][0]);
      acc[0][m][1] = _mm256_fmadd_ps(xb, hi, acc[0][m][1]);
    }
  }
#pragma GCC unroll 8
  for (int m = 0; m < MR; ++m) {
#pragma GCC unroll 8
    for (int u = 1; u < U; ++u) {
      acc[0][m][0] = _mm256_add_ps(acc[0][m][0], acc[u][m][0]);
      acc[0][m][1] = _mm256_add_ps(acc[0][m][1], acc[u][m][1]);
    }
    _mm256_storeu_ps(y + m * N, acc[0][m][0]);
    _mm256_storeu_ps(y + m * N + 8, acc[0][m][1]);
  }
}

template <typename W>
inline void tile(int rows, const float* x, int64_t K, const W* panel, float* y, int64_t N, const char* next) {
  switch (rows) {
    case 1: micro<1, 4>(x, K, panel, y, N, next); break;
    case 2: micro<2, 2>(x, K, panel, y, N, next); break;
    case 3: micro<3, 2>(x, K, panel, y, N, next); break;
    case 4: micro<4, 1>(x, K, panel, y, N, next); break;
    case 5: micro<5, 1>(x, K, panel, y, N, next); break;
    default: micro<6, 1>(x, K, panel, y, N, next); break;
  }
}

// Panels [p0, p1) for every row of x: rows in L2-sized blocks, each block split into tiles
// of at most kMaxRows rows as evenly as possible (32 rows: 6, 6, 5, 5, 5, 5; a 2-row tail
// tile would run at half the FMA rate).
template <typename W>
void panels(const float* x, const W* w, float* y, int64_t M, int64_t K, int64_t N, int64_t p0, int64_t p1) {
  const int64_t block = std::max<int64_t>(kMaxRows, kBlockBytes / (K * 4) / kMaxRows * kMaxRows);
  for (int64_t m0 = 0; m0 < M; m0 += block) {
    const int64_t rows = std::min(block, M - m0);
    const int64_t tiles = (rows + kMaxRows - 1) / kMaxRows;
    for (int64_t p = p0; p < p1; ++p) {
      const W* panel = w + p * K * kPanel;
      const char* next = p + 1 < p1 ? reinterpret_cast<const char*>(panel + K * kPanel) : nullptr;
      int64_t m = m0;
      for (int64_t t = 0; t < tiles; ++t) {
        const int r = static_cast<int>(rows / tiles + (t < rows % tiles));
        tile(r, x + m * K, K, panel, y + m * N + p * kPanel, N, t == 0 ? next : nullptr);
        m += r;
      }
    }
  }
}

// The N % 16 plain rows after the panels: one dot product per (row of x, weight row).
template <typename W>
void tail_rows(const float* x, const W* w, float* y, int64_t M, int64_t K, int64_t N, int64_t n0) {
  for (int64_t n = n0; n < N; ++n) {
    const W* wr = w + n * K;
    for (int64_t m = 0; m < M; ++m) {
      const float* xr = x + m * K;
      __m256 acc = _mm256_setzero_ps();
      int64_t k = 0;
      for (; k + 8 <= K; k += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(xr + k), load8(wr + k), acc);
      float s = hsum(acc);
      for (; k < K; ++k) s += xr[k] * to_f32(wr[k]);
      y[m * N + n] = s;
    }
  }
}

template <typename W>
void linear(ffi::ThreadPool& pool, const float* x, const W* w, float* y, int64_t M, int64_t K, int64_t N) {
  const int64_t P = N / kPanel;
  tail_rows(x, w, y, M, K, N, P * kPanel);
  if (P == 0) return;
  // XLA:CPU's own workers would spin against a separate OpenMP team on the same cores
  // (measured: two OpenMP threads were no faster than one inside a step), so the panels
  // are split over XLA's intra-op pool instead, in several parts per thread so that a late
  // start or a slower core costs at most a small part at the end.  Measured on two cores
  // in a standalone harness (SmolLM2's matrices, bf16): at 32 rows 8 parts per thread ran at
  // 165 GFLOP/s against 134 with 2 or 4, and 145 with 16; at 1 row (memory bound) 4 per
  // thread was best.
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  const int64_t per_thread = M > 8 ? 8 : 4;
  const int parts = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(per_thread * threads, P / 6)));
  if (parts == 1) {
    panels(x, w, y, M, K, N, 0, P);
    return;
  }
  const int64_t chunk = (P + parts - 1) / parts;
  // The calling thread works too, so threads - 1 tasks fill the pool's cores; one more only
  // queued a wake-up behind them (measured on two cores: a batch-1 step's matmuls 17.0 ms
  // against 21.0 ms with as many tasks as threads).
  const int64_t tasks = std::max<int64_t>(1, std::min<int64_t>(threads - 1, parts - 1));
  jaxllm_parallel::for_each_item(pool, parts, tasks, [=](int64_t i) {
    const int64_t q0 = std::min<int64_t>(P, i * chunk), q1 = std::min<int64_t>(P, q0 + chunk);
    if (q0 < q1) panels(x, w, y, M, K, N, q0, q1);
  });
}

template <ffi::DataType WT>
ffi::Error LinearImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<WT> w, ffi::ResultBuffer<ffi::F32> y) {
  auto xd = x.dimensions();
  auto wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2 || xd[1] != wd[1])
    return ffi::Error::InvalidArgument("jaxllm_linear: expected x[M, K] and a packed w[N, K]");
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
