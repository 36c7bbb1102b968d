// What the AVX-512 float32 FMA units of this CPU give to three loop shapes, one core and
// both at once (GFLOP/s): the ceiling the Q4_1 prefill panels (jaxllm/cpu/quant_linear.cc)
// can reach with their arithmetic, against the machine's peak and another loop form.
//
//     g++ -O3 -march=native -pthread bench/fma_ceiling.cc -o /tmp/fma_ceiling && /tmp/fma_ceiling
//
//   peak   12 independent FMA chains on registers, no loads: the FMA units' rate.
//   dot    the panels' 4 x 4 tile: per 32-weight block and (row of x, weight row) pair,
//          acc = fma(w_hi, x_hi, fma(w_lo, x_lo, acc)) on 16 lanes along K (a decode step's
//          walk does the same operations, so a row's bits do not depend on M), then a
//          horizontal sum per pair; K = 576, x and 4 weight rows in L1 ("L1"), or the weight
//          rows walked over a 64-row panel (147 KB, from L2) as the kernel does ("L2").
//   outer  an outer-product tile (6 rows of x x 64 weight rows: lanes along the weight
//          rows, x broadcast), the form optimized GEMMs use; weights and x in L1.  Its sums
//          run along K in another order: it would give other bits than today's walk.
// Needs AVX-512F; prints why and exits 0 without it.
#include <immintrin.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <thread>
#include <vector>

namespace {

constexpr long kK = 576;   // the built-in model's hidden size (K of qkv, o and gate_up)

__attribute__((target("avx512f"))) float peak(long iters) {
  __m512 a[12];
  const __m512 x = _mm512_set1_ps(1.0000001f), y = _mm512_set1_ps(0.9999999f);
  for (int i = 0; i < 12; ++i) a[i] = _mm512_set1_ps(static_cast<float>(i));
  for (long it = 0; it < iters; ++it)
    for (int i = 0; i < 12; ++i) a[i] = _mm512_fmadd_ps(a[i], x, y);
  __m512 s = a[0];
  for (int i = 1; i < 12; ++i) s = _mm512_add_ps(s, a[i]);
  return _mm512_reduce_add_ps(s);
}

// One 4 x 4 tile over K: x [4, K], w [4, K] as the panels hold them (32-weight blocks).
__attribute__((target("avx512f"), noinline)) void dot_tile(const float* x, const float* w, float* y) {
  __m512 acc[4][4];
  for (auto& row : acc)
    for (auto& a : row) a = _mm512_setzero_ps();
  for (long b = 0; b < kK / 32; ++b) {
    __m512 xlo[4], xhi[4];
    for (int r = 0; r < 4; ++r) {
      xlo[r] = _mm512_load_ps(x + r * kK + b * 32);
      xhi[r] = _mm512_load_ps(x + r * kK + b * 32 + 16);
    }
    for (int j = 0; j < 4; ++j) {
      const __m512 wlo = _mm512_load_ps(w + j * kK + b * 32), whi = _mm512_load_ps(w + j * kK + b * 32 + 16);
      for (int r = 0; r < 4; ++r) acc[r][j] = _mm512_fmadd_ps(whi, xhi[r], _mm512_fmadd_ps(wlo, xlo[r], acc[r][j]));
    }
  }
  for (int r = 0; r < 4; ++r)
    for (int j = 0; j < 4; ++j) y[r * 4 + j] = _mm512_reduce_add_ps(acc[r][j]);
}

// One 6 x 64 outer-product tile over K: x packed [K, 6], w packed [K, 64].
__attribute__((target("avx512f"), noinline)) void outer_tile(const float* x, const float* w, float* y) {
  __m512 acc[6][4];
  for (auto& row : acc)
    for (auto& a : row) a = _mm512_setzero_ps();
  for (long k = 0; k < kK; ++k) {
    __m512 wv[4];
    for (int v = 0; v < 4; ++v) wv[v] = _mm512_load_ps(w + k * 64 + v * 16);
    for (int r = 0; r < 6; ++r) {
      const __m512 xb = _mm512_set1_ps(x[k * 6 + r]);
      for (int v = 0; v < 4; ++v) acc[r][v] = _mm512_fmadd_ps(wv[v], xb, acc[r][v]);
    }
  }
  for (int r = 0; r < 6; ++r)
    for (int v = 0; v < 4; ++v) _mm512_store_ps(y + (r * 4 + v) * 16, acc[r][v]);
}

float* lines(long n, float scale) {   // n floats on 64-byte lines, small values
  auto* p = static_cast<float*>(std::aligned_alloc(64, (n * 4 + 63) / 64 * 64));
  for (long i = 0; i < n; ++i) p[i] = scale * static_cast<float>(i % 7);
  return p;
}

// GFLOP/s of calls(n) (flop_per_call per unit of n) on `threads` threads at once: each thread
// calls it in rounds of 100 for half a second, the median round counted.
double rate(int threads, double flop_per_call, const std::function<void(long)>& calls) {
  std::vector<double> got(threads);
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t)
    pool.emplace_back([&, t] {
      calls(100);   // warm
      std::vector<double> rounds;
      const auto start = std::chrono::steady_clock::now();
      while (std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() < 0.5) {
        const auto t0 = std::chrono::steady_clock::now();
        calls(100);
        rounds.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
      }
      std::nth_element(rounds.begin(), rounds.begin() + rounds.size() / 2, rounds.end());
      got[t] = 100 * flop_per_call / rounds[rounds.size() / 2];
    });
  for (auto& th : pool) th.join();
  double sum = 0;
  for (double g : got) sum += g;
  return sum / 1e9;
}

}  // namespace

int main() {
  __builtin_cpu_init();
  if (!__builtin_cpu_supports("avx512f")) {
    std::printf("no AVX-512F on this CPU: nothing to measure\n");
    return 0;
  }
  const float* x = lines(4 * kK, 1e-3f);
  const float* panel = lines(64 * kK, 1e-3f);
  const float* xo = lines(6 * kK, 1e-3f);
  const float* wo = lines(64 * kK, 1e-3f);
  const auto dot = [&](bool stream) {
    return [&, stream](long n) {
      alignas(64) float y[16];
      for (long i = 0; i < n * 16; ++i) dot_tile(x, panel + (stream ? (i % 16) * 4 * kK : 0), y);
      if (y[0] < 0) std::printf("%g", y[0]);
    };
  };
  const auto outer = [&](long n) {
    alignas(64) static thread_local float y[6 * 64];
    for (long i = 0; i < n * 4; ++i) outer_tile(xo, wo, y);
    if (y[0] < 0) std::printf("%g", y[0]);
  };
  const auto fma_peak = [](long n) {
    if (peak(n * 2000) == 12345.f) std::printf("!");
  };
  std::printf("| loop | one core, GFLOP/s | both cores, GFLOP/s |\n|---|---:|---:|\n");
  const struct {
    const char* name;
    double flop;
    std::function<void(long)> f;
  } rows[] = {
      {"peak: 12 FMA chains on registers", 2000.0 * 12 * 32, fma_peak},
      {"dot: the panels' 4 x 4 tile, L1", 16.0 * 4 * 4 * kK * 2, dot(false)},
      {"dot: the panels' 4 x 4 tile, a 64-row panel (L2)", 16.0 * 4 * 4 * kK * 2, dot(true)},
      {"outer: 6 x 64 outer-product tile, L1", 4.0 * 6 * 64 * kK * 2, outer},
  };
  for (const auto& r : rows)
    std::printf("| %s | %.1f | %.1f |\n", r.name, rate(1, r.flop, r.f), rate(2, r.flop, r.f));
  return 0;
}
