// Native CPU matmul over GGUF blocks kept packed: y[M, N] = x[M, K] . dequant(w)[N, K]^T,
// float32 accumulation, for Q8_0, Q4_0, Q4_1, Q5_0 and Q5_1 weights split into per-field
// arrays by jaxllm/quant/gguf_blocks.py (d, m: [N, nb] float16 bits; qs: [N, nb, 32 | 16]
// bytes; qh: [N, nb, 4] bytes, the fifth bits of Q5_*; nb = K / 32).
//
// The weights are never dequantized to memory: each 32-weight block is widened in
// registers (int8 or nibbles [+ fifth bit] -> int32 -> float32), multiplied by x with FMAs
// into a block partial, and the block's scale d (F16C) is applied once per block:
//   Q8_0, Q4_0, Q5_0: y += d * sum(q * x)   (Q4_0, Q5_0: q - 8, q - 16 taken in the bytes,
//                                             so the widened weights are exact integers)
//   Q4_1, Q5_1:       y += d * sum(q * x) + m * sum(x)
// sum(x) per block is computed once per row of x, before the rows of w are split.
// A block, once widened, is reused for up to kMaxRows rows of x; the weight rows are split
// over XLA's intra-op thread pool in contiguous ranges, as in linear.cc.
// Called from jaxllm/cpu/native.py via XLA's FFI.
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "parallel.h"
#include "simd.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kBlock = 32;
constexpr int kMaxRows = 4;   // rows of x per tile: 4 weight vectors + 4 accumulators + partials

inline float f16(uint16_t bits) { return _cvtsh_ss(bits); }

// bytes 0..15 -> four float32 vectors of 4 x 8 lanes, signed or unsigned
template <bool Signed>
inline void widen16(__m128i v, __m256 q[2]) {
  if (Signed) {
    q[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v));
    q[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(v, 8)));
  } else {
    q[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v));
    q[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(v, 8)));
  }
}

// qs bytes -> (low nibbles, high nibbles): weights 0..15 and 16..31 as bytes 0..15
inline void nibbles(const uint8_t* qs, __m128i* lo, __m128i* hi) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  const __m128i mask = _mm_set1_epi8(0x0F);
  *lo = _mm_and_si128(v, mask);
  *hi = _mm_and_si128(_mm_srli_epi16(v, 4), mask);
}

// Bits 0..15 (lo) and 16..31 (hi) of the little-endian uint32 qh as bytes 0x10 or 0:
// weight j's fifth bit, placed to be or-ed onto its nibble.
inline void fifth_bits(const uint8_t* qh, __m128i* lo, __m128i* hi) {
  int32_t h;
  __builtin_memcpy(&h, qh, 4);
  const __m128i v = _mm_set1_epi32(h);
  // byte j of a half takes the qh byte holding its bit, then tests bit j % 8
  const __m128i pick_lo = _mm_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
  const __m128i pick_hi = _mm_setr_epi8(2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
  const __m128i bit = _mm_set1_epi64x(static_cast<int64_t>(0x8040201008040201ULL));
  const __m128i sixteen = _mm_set1_epi8(0x10);
  *lo = _mm_and_si128(_mm_cmpeq_epi8(_mm_and_si128(_mm_shuffle_epi8(v, pick_lo), bit), bit), sixteen);
  *hi = _mm_and_si128(_mm_cmpeq_epi8(_mm_and_si128(_mm_shuffle_epi8(v, pick_hi), bit), bit), sixteen);
}

// One block's 32 weights (without d, m) as four float32 vectors, weights 0..7, ..., 24..31.
// qh: the block's 4 high-bit bytes (Q5_*), unused by the other types.
struct Q8_0 {
  static constexpr int64_t kQsBytes = 32;
  static constexpr int64_t kQhBytes = 0;
  static inline void widen(const uint8_t* qs, const uint8_t*, __m256 q[4]) {
    for (int i = 0; i < 4; ++i) {
      const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(qs + 8 * i));
      q[i] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));   // signed int8 quants
    }
  }
};

// Q4_0: weight d * (q - 8); the offset is subtracted in the bytes, so q lanes are -8..7.
struct Q4_0 {
  static constexpr int64_t kQsBytes = 16;
  static constexpr int64_t kQhBytes = 0;
  static inline void widen(const uint8_t* qs, const uint8_t*, __m256 q[4]) {
    __m128i lo, hi;
    nibbles(qs, &lo, &hi);
    const __m128i off = _mm_set1_epi8(8);
    widen16<true>(_mm_sub_epi8(lo, off), q);
    widen16<true>(_mm_sub_epi8(hi, off), q + 2);
  }
};

// Q5_0: weight d * (q - 16), q = nibble | fifth bit << 4; q lanes are -16..15.
struct Q5_0 {
  static constexpr int64_t kQsBytes = 16;
  static constexpr int64_t kQhBytes = 4;
  static inline void widen(const uint8_t* qs, const uint8_t* qh, __m256 q[4]) {
    __m128i lo, hi, hlo, hhi;
    nibbles(qs, &lo, &hi);
    fifth_bits(qh, &hlo, &hhi);
    const __m128i off = _mm_set1_epi8(16);
    widen16<true>(_mm_sub_epi8(_mm_or_si128(lo, hlo), off), q);
    widen16<true>(_mm_sub_epi8(_mm_or_si128(hi, hhi), off), q + 2);
  }
};

// Q5_1: weight d * q + m, q = nibble | fifth bit << 4 in 0..31.
struct Q5_1 {
  static constexpr int64_t kQsBytes = 16;
  static constexpr int64_t kQhBytes = 4;
  static inline void widen(const uint8_t* qs, const uint8_t* qh, __m256 q[4]) {
    __m128i lo, hi, hlo, hhi;
    nibbles(qs, &lo, &hi);
    fifth_bits(qh, &hlo, &hhi);
    widen16<false>(_mm_or_si128(lo, hlo), q);
    widen16<false>(_mm_or_si128(hi, hhi), q + 2);
  }
};

struct Q4_1 {
  static constexpr int64_t kQsBytes = 16;
  static constexpr int64_t kQhBytes = 0;
  // byte j: weight j in the low nibble, weight j + 16 in the high nibble
  static inline void widen(const uint8_t* qs, const uint8_t*, __m256 q[4]) {
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
    const __m128i mask = _mm_set1_epi8(0x0F);
    const __m128i lo = _mm_and_si128(v, mask), hi = _mm_and_si128(_mm_srli_epi16(v, 4), mask);
    q[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
    q[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
    q[2] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
    q[3] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
  }
};

// y[r, n] for r < MR rows of x (K apart) and one weight row n; y rows N apart.
// sx: the rows' per-block sums of x ([MR, nb], nb apart), used only when m != nullptr.
template <int MR, typename T>
inline void row_tile(const float* x, int64_t K, const uint16_t* d, const uint16_t* m, const uint8_t* qs,
                     const uint8_t* qh, const float* sx, float* y, int64_t N) {
  const int64_t nb = K / kBlock;
  __m256 acc[MR];
  float macc[MR];
  for (int r = 0; r < MR; ++r) {
    acc[r] = _mm256_setzero_ps();
    macc[r] = 0.0f;
  }
  for (int64_t b = 0; b < nb; ++b) {
    __m256 q[4];
    T::widen(qs + b * T::kQsBytes, qh + b * T::kQhBytes, q);
    const __m256 db = _mm256_set1_ps(f16(d[b]));
    const float* xb = x + b * kBlock;
#pragma GCC unroll 4
    for (int r = 0; r < MR; ++r) {
      const float* xr = xb + r * K;
      __m256 s = _mm256_mul_ps(q[0], _mm256_loadu_ps(xr));
      s = _mm256_fmadd_ps(q[1], _mm256_loadu_ps(xr + 8), s);
      s = _mm256_fmadd_ps(q[2], _mm256_loadu_ps(xr + 16), s);
      s = _mm256_fmadd_ps(q[3], _mm256_loadu_ps(xr + 24), s);
      acc[r] = _mm256_fmadd_ps(db, s, acc[r]);
    }
    if (m != nullptr) {
      const float mb = f16(m[b]);
#pragma GCC unroll 4
      for (int r = 0; r < MR; ++r) macc[r] += mb * sx[r * nb + b];
    }
  }
  for (int r = 0; r < MR; ++r) y[r * N] = jaxllm_simd::hsum(acc[r]) + macc[r];
}

template <typename T>
inline void tile(int rows, const float* x, int64_t K, const uint16_t* d, const uint16_t* m, const uint8_t* qs,
                 const uint8_t* qh, const float* sx, float* y, int64_t N) {
  switch (rows) {
    case 1: row_tile<1, T>(x, K, d, m, qs, qh, sx, y, N); break;
    case 2: row_tile<2, T>(x, K, d, m, qs, qh, sx, y, N); break;
    case 3: row_tile<3, T>(x, K, d, m, qs, qh, sx, y, N); break;
    default: row_tile<4, T>(x, K, d, m, qs, qh, sx, y, N); break;
  }
}

// Weight rows [n0, n1) for every row of x.  The tile of x (at most kMaxRows * K floats) is
// the outer loop: it is read 4 times per block per weight row, so it stays in L1 while the
// weight rows (about a quarter of its bytes per block) stream through.
template <typename T>
void rows_range(const float* x, const uint16_t* d, const uint16_t* m, const uint8_t* qs, const uint8_t* qh,
                const float* sx, float* y, int64_t M, int64_t K, int64_t N, int64_t n0, int64_t n1) {
  const int64_t nb = K / kBlock;
  const int64_t tiles = (M + kMaxRows - 1) / kMaxRows;
  int64_t r0 = 0;
  for (int64_t t = 0; t < tiles; ++t) {
    // tiles as even as possible (7 rows: 4 + 3, not 4 + 3 ... or a 1-row tail)
    const int rows = static_cast<int>(M / tiles + (t < M % tiles));
    for (int64_t n = n0; n < n1; ++n) {
      tile<T>(rows, x + r0 * K, K, d + n * nb, m ? m + n * nb : nullptr, qs + n * nb * T::kQsBytes,
              qh + n * nb * T::kQhBytes, sx ? sx + r0 * nb : nullptr, y + r0 * N + n, N);
    }
    r0 += rows;
  }
}

template <typename T>
void linear(ffi::ThreadPool& pool, const float* x, const uint16_t* d, const uint16_t* m, const uint8_t* qs,
            const uint8_t* qh, float* y, int64_t M, int64_t K, int64_t N) {
  const int64_t nb = K / kBlock;
  std::vector<float> sums;
  if (m != nullptr) {
    sums.resize(M * nb);   // [M, nb]
    for (int64_t r = 0; r < M; ++r)
      for (int64_t b = 0; b < nb; ++b) {
        const float* xb = x + r * K + b * kBlock;
        __m256 s = _mm256_add_ps(_mm256_add_ps(_mm256_loadu_ps(xb), _mm256_loadu_ps(xb + 8)),
                                 _mm256_add_ps(_mm256_loadu_ps(xb + 16), _mm256_loadu_ps(xb + 24)));
        sums[r * nb + b] = jaxllm_simd::hsum(s);
      }
  }
  const float* sx = m != nullptr ? sums.data() : nullptr;
  // Parts per thread and tasks = threads - 1 (the caller works too): the choices linear.cc
  // measured for the same pool; a part is at least 8 weight rows.
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  const int64_t per_thread = M > 8 ? 8 : 4;
  const int parts = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(per_thread * threads, N / 8)));
  if (parts == 1) {
    rows_range<T>(x, d, m, qs, qh, sx, y, M, K, N, 0, N);
    return;
  }
  const int64_t chunk = (N + parts - 1) / parts;
  const int64_t tasks = std::max<int64_t>(1, std::min<int64_t>(threads - 1, parts - 1));
  jaxllm_parallel::for_each_item(pool, parts, tasks, [=](int64_t i) {
    const int64_t a = std::min<int64_t>(N, i * chunk), b = std::min<int64_t>(N, a + chunk);
    if (a < b) rows_range<T>(x, d, m, qs, qh, sx, y, M, K, N, a, b);
  });
}

ffi::Error check(const char* name, ffi::Span<const int64_t> xd, ffi::Span<const int64_t> dd,
                 ffi::Span<const int64_t> qd, int64_t qs_bytes) {
  if (xd.size() != 2 || dd.size() != 2 || qd.size() != 3 || xd[1] % kBlock != 0 ||
      dd[1] != xd[1] / kBlock || qd[0] != dd[0] || qd[1] != dd[1] || qd[2] != qs_bytes)
    return ffi::Error::InvalidArgument(std::string(name) +
                                       ": expected x[M, K], d[N, K/32] and qs[N, K/32, block bytes]");
  return ffi::Error::Success();
}

ffi::Error LinearQ8_0(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U16> d,
                      ffi::Buffer<ffi::U8> qs, ffi::ResultBuffer<ffi::F32> y) {
  auto xd = x.dimensions();
  if (auto e = check("jaxllm_linear_q8_0", xd, d.dimensions(), qs.dimensions(), Q8_0::kQsBytes); e.failure())
    return e;
  linear<Q8_0>(pool, x.typed_data(), d.typed_data(), nullptr, qs.typed_data(), nullptr, y->typed_data(), xd[0],
               xd[1], d.dimensions()[0]);
  return ffi::Error::Success();
}

ffi::Error LinearQ4_1(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U16> d,
                      ffi::Buffer<ffi::U16> m, ffi::Buffer<ffi::U8> qs, ffi::ResultBuffer<ffi::F32> y) {
  auto xd = x.dimensions();
  if (auto e = check("jaxllm_linear_q4_1", xd, d.dimensions(), qs.dimensions(), Q4_1::kQsBytes); e.failure())
    return e;
  auto md = m.dimensions();
  if (md.size() != 2 || md[0] != d.dimensions()[0] || md[1] != d.dimensions()[1])
    return ffi::Error::InvalidArgument("jaxllm_linear_q4_1: m must have d's shape [N, K/32]");
  linear<Q4_1>(pool, x.typed_data(), d.typed_data(), m.typed_data(), qs.typed_data(), nullptr, y->typed_data(),
               xd[0], xd[1], d.dimensions()[0]);
  return ffi::Error::Success();
}

ffi::Error LinearQ4_0(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U16> d,
                      ffi::Buffer<ffi::U8> qs, ffi::ResultBuffer<ffi::F32> y) {
  auto xd = x.dimensions();
  if (auto e = check("jaxllm_linear_q4_0", xd, d.dimensions(), qs.dimensions(), Q4_0::kQsBytes); e.failure())
    return e;
  linear<Q4_0>(pool, x.typed_data(), d.typed_data(), nullptr, qs.typed_data(), nullptr, y->typed_data(), xd[0],
               xd[1], d.dimensions()[0]);
  return ffi::Error::Success();
}

ffi::Error check_qh(const char* name, ffi::Span<const int64_t> dd, ffi::Span<const int64_t> hd) {
  if (hd.size() != 3 || hd[0] != dd[0] || hd[1] != dd[1] || hd[2] != 4)
    return ffi::Error::InvalidArgument(std::string(name) + ": qh must be [N, K/32, 4]");
  return ffi::Error::Success();
}

ffi::Error LinearQ5_0(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U16> d,
                      ffi::Buffer<ffi::U8> qh, ffi::Buffer<ffi::U8> qs, ffi::ResultBuffer<ffi::F32> y) {
  auto xd = x.dimensions();
  if (auto e = check("jaxllm_linear_q5_0", xd, d.dimensions(), qs.dimensions(), Q5_0::kQsBytes); e.failure())
    return e;
  if (auto e = check_qh("jaxllm_linear_q5_0", d.dimensions(), qh.dimensions()); e.failure()) return e;
  linear<Q5_0>(pool, x.typed_data(), d.typed_data(), nullptr, qs.typed_data(), qh.typed_data(), y->typed_data(),
               xd[0], xd[1], d.dimensions()[0]);
  return ffi::Error::Success();
}

ffi::Error LinearQ5_1(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U16> d,
                      ffi::Buffer<ffi::U16> m, ffi::Buffer<ffi::U8> qh, ffi::Buffer<ffi::U8> qs,
                      ffi::ResultBuffer<ffi::F32> y) {
  auto xd = x.dimensions();
  if (auto e = check("jaxllm_linear_q5_1", xd, d.dimensions(), qs.dimensions(), Q5_1::kQsBytes); e.failure())
    return e;
  auto md = m.dimensions();
  if (md.size() != 2 || md[0] != d.dimensions()[0] || md[1] != d.dimensions()[1])
    return ffi::Error::InvalidArgument("jaxllm_linear_q5_1: m must have d's shape [N, K/32]");
  if (auto e = check_qh("jaxllm_linear_q5_1", d.dimensions(), qh.dimensions()); e.failure()) return e;
  linear<Q5_1>(pool, x.typed_data(), d.typed_data(), m.typed_data(), qs.typed_data(), qh.typed_data(),
               y->typed_data(), xd[0], xd[1], d.dimensions()[0]);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxllmLinearQ8_0, LinearQ8_0,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U16>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxllmLinearQ4_1, LinearQ4_1,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U16>>()
                                  .Arg<ffi::Buffer<ffi::U16>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxllmLinearQ4_0, LinearQ4_0,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U16>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxllmLinearQ5_0, LinearQ5_0,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // x
                                  .Arg<ffi::Buffer<ffi::U16>>()   // d
                                  .Arg<ffi::Buffer<ffi::U8>>()    // qh
                                  .Arg<ffi::Buffer<ffi::U8>>()    // qs
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxllmLinearQ5_1, LinearQ5_1,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // x
                                  .Arg<ffi::Buffer<ffi::U16>>()   // d
                                  .Arg<ffi::Buffer<ffi::U16>>()   // m
                                  .Arg<ffi::Buffer<ffi::U8>>()    // qh
                                  .Arg<ffi::Buffer<ffi::U8>>()    // qs
                                  .Ret<ffi::Buffer<ffi::F32>>());
