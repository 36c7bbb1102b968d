// Native CPU matmul over GGUF blocks with 8-bit activations: y[M, N] = x[M, K] . W[N, K]^T
// for Q8_0, Q4_0, Q4_1, Q5_0 and Q5_1 weights in jaxllm/quant/gguf_blocks.py's per-field
// arrays (d, m: [N, nb] float16 bits; qs: [N, nb, 32 | 16] bytes; qh: [N, nb, 4]; nb = K/32).
//
// Each 32-value block of a row of x is quantized once per call to int8 with its own scale
// (dx = max|x| / 127, round to nearest), as llama.cpp's Q8_0 activations; a weight block
// and an activation block then meet in integer arithmetic: 32 byte products summed to
// int32 by two instructions (maddubs, madd), scaled once by d * dx.  Per block:
//   Q8_0, Q4_0, Q5_0: y += d * dx * sum(q * qx)       (q - 8, q - 16 taken in the bytes)
//   Q4_1, Q5_1:       y += d * dx * sum(q * qx) + m * sum(x)
// sum(x) is the float sum of the block of x, not of its quantized values, so the min term
// is exact.  Four times the lanes of quant_linear.cc's float32 FMAs per instruction; the
// cost is the activations' rounding, at most dx / 2 per value (measured and bounded in
// tests/kernels/test_cpu_quant_dot.py).  Weight rows are split over XLA's intra-op thread
// pool as in quant_linear.cc (gguf_simd.h's split_rows).  Called from jaxllm/quant/native_matmul.py via XLA's FFI.
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "gguf_simd.h"
#include "parallel.h"
#include "simd.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
using jaxllm_gguf::f16;
using jaxllm_gguf::rows_range_prefetched;
using jaxllm_gguf::split_rows;

namespace {

constexpr int64_t kBlock = 32;

// x [M, K] -> qx [M, K] int8 and, per block, dx [M, nb] (the scale) and sx [M, nb] (sum of x).
void quantize_rows(const float* x, int64_t M, int64_t K, int8_t* qx, float* dx, float* sx) {
  const int64_t nb = K / kBlock;
  const __m256 sign = _mm256_set1_ps(-0.0f);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int64_t i = 0; i < M * nb; ++i) {
    const float* xb = x + i * kBlock;
    __m256 v[4];
    __m256 amax = _mm256_setzero_ps();
    for (int j = 0; j < 4; ++j) {
      v[j] = _mm256_loadu_ps(xb + 8 * j);
      amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[j]));
    }
    const float d = jaxllm_simd::hmax(amax) / 127.0f;
    const __m256 inv = _mm256_set1_ps(d > 0.0f ? 1.0f / d : 0.0f);
    __m256i q[4];
    for (int j = 0; j < 4; ++j)
      q[j] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v[j], inv), _MM_FROUND_TO_NEAREST_INT |
                                                                            _MM_FROUND_NO_EXC));
    // int32 x 32 -> int8 x 32; the packs interleave 128-bit lanes, the permute restores order
    const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(qx + i * kBlock), _mm256_permutevar8x32_epi32(p, order));
    dx[i] = d;
    sx[i] = jaxllm_simd::hsum(_mm256_add_ps(_mm256_add_ps(v[0], v[1]), _mm256_add_ps(v[2], v[3])));
  }
}

// A block's 32 weights (without d, m) as bytes 0..31 in weight order; kSigned: int8 lanes
// (else 0..31 unsigned); kMin: the type adds m * sum(x).
struct Q8_0 {
  static constexpr int64_t kQsBytes = 32, kQhBytes = 0;
  static constexpr bool kSigned = true, kMin = false;
  static inline __m256i load(const uint8_t* qs, const uint8_t*) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs));
  }
};

inline __m256i nibble_bytes(const uint8_t* qs) {
  __m128i lo, hi;
  jaxllm_gguf::nibbles(qs, &lo, &hi);
  return _mm256_set_m128i(hi, lo);
}

inline __m256i five_bit_bytes(const uint8_t* qs, const uint8_t* qh) {
  __m128i lo, hi, hlo, hhi;
  jaxllm_gguf::nibbles(qs, &lo, &hi);
  jaxllm_gguf::fifth_bits(qh, &hlo, &hhi);
  return _mm256_set_m128i(_mm_or_si128(hi, hhi), _mm_or_si128(lo, hlo));
}

struct Q4_0 {
  static constexpr int64_t kQsBytes = 16, kQhBytes = 0;
  static constexpr bool kSigned = true, kMin = false;
  static inline __m256i load(const uint8_t* qs, const uint8_t*) {
    return _mm256_sub_epi8(nibble_bytes(qs), _mm256_set1_epi8(8));
  }
};

struct Q4_1 {
  static constexpr int64_t kQsBytes = 16, kQhBytes = 0;
  static constexpr bool kSigned = false, kMin = true;
  static inline __m256i load(const uint8_t* qs, const uint8_t*) { return nibble_bytes(qs); }
};

struct Q5_0 {
  static constexpr int64_t kQsBytes = 16, kQhBytes = 4;
  static constexpr bool kSigned = true, kMin = false;
  static inline __m256i load(const uint8_t* qs, const uint8_t* qh) {
    return _mm256_sub_epi8(five_bit_bytes(qs, qh), _mm256_set1_epi8(16));
  }
};

struct Q5_1 {
  static constexpr int64_t kQsBytes = 16, kQhBytes = 4;
  static constexpr bool kSigned = false, kMin = true;
  static inline __m256i load(const uint8_t* qs, const uint8_t* qh) { return five_bit_bytes(qs, qh); }
};

// sum(w * a) over 32 byte lanes as 8 float32 partial sums.  maddubs multiplies unsigned by
// signed bytes, so signed weights lend their sign to the activations (|w| * sign(a, w));
// its int16 pair sums cannot saturate: at most 2 * 128 * 127.
template <bool Signed>
inline __m256 dot32(__m256i w, __m256i a) {
  const __m256i p16 = Signed ? _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(a, w))
                             : _mm256_maddubs_epi16(w, a);
  return _mm256_cvtepi32_ps(_mm256_madd_epi16(p16, _mm256_set1_epi16(1)));
}

struct Activations {
  const int8_t* q;   // [M, K]
  const float* d;    // [M, nb]
  const float* s;    // [M, nb]
};

// y[r, n] for r < MR rows of the quantized x (starting at row r0) and one weight row n.
template <int MR, typename T>
inline void row_tile(const Activations& a, int64_t r0, int64_t K, const uint16_t* d, const uint16_t* m,
                     const uint8_t* qs, const uint8_t* qh, float* y, int64_t N) {
  const int64_t nb = K / kBlock;
  __m256 acc[MR];
  float macc[MR];
  for (int r = 0; r < MR; ++r) {
    acc[r] = _mm256_setzero_ps();
    macc[r] = 0.0f;
  }
  for (int64_t b = 0; b < nb; ++b) {
    const __m256i w = T::load(qs + b * T::kQsBytes, qh + b * T::kQhBytes);
    const float db = f16(d[b]);
#pragma GCC unroll 4
    for (int r = 0; r < MR; ++r) {
      const int64_t i = (r0 + r) * nb + b;
      const __m256i qa = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.q + i * kBlock));
      acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(db * a.d[i]), dot32<T::kSigned>(w, qa), acc[r]);
    }
    if (T::kMin) {
      const float mb = f16(m[b]);
#pragma GCC unroll 4
      for (int r = 0; r < MR; ++r) macc[r] += mb * a.s[(r0 + r) * nb + b];
    }
  }
  for (int r = 0; r < MR; ++r) y[r * N] = jaxllm_simd::hsum(acc[r]) + macc[r];
}

template <typename T>
inline void tile(int rows, const Activations& a, int64_t r0, int64_t K, const uint16_t* d, const uint16_t* m,
                 const uint8_t* qs, const uint8_t* qh, float* y, int64_t N) {
  switch (rows) {
    case 1: row_tile<1, T>(a, r0, K, d, m, qs, qh, y, N); break;
    case 2: row_tile<2, T>(a, r0, K, d, m, qs, qh, y, N); break;
    case 3: row_tile<3, T>(a, r0, K, d, m, qs, qh, y, N); break;
    default: row_tile<4, T>(a, r0, K, d, m, qs, qh, y, N); break;
  }
}

template <typename T>
void linear(ffi::ThreadPool& pool, const float* x, const uint16_t* d, const uint16_t* m, const uint8_t* qs,
            const uint8_t* qh, float* y, int64_t M, int64_t K, int64_t N) {
  const int64_t nb = K / kBlock;
  std::vector<int8_t> qx(M * K);
  std::vector<float> dx(M * nb), sx(M * nb);
  quantize_rows(x, M, K, qx.data(), dx.data(), sx.data());
  const Activations a{qx.data(), dx.data(), sx.data()};
  const auto prefetch_row = [=](int64_t ahead) {
    jaxllm_gguf::prefetch(qs + ahead * nb * T::kQsBytes, nb * T::kQsBytes);
    jaxllm_gguf::prefetch(d + ahead * nb, nb * 2);
    if (m) jaxllm_gguf::prefetch(m + ahead * nb, nb * 2);
    if (T::kQhBytes) jaxllm_gguf::prefetch(qh + ahead * nb * T::kQhBytes, nb * T::kQhBytes);
  };
  split_rows(pool, M, N, [&a, d, m, qs, qh, y, M, K, N, nb, &prefetch_row](int64_t n0, int64_t n1) {
    rows_range_prefetched(M, n0, n1, prefetch_row, [&a, d, m, qs, qh, y, K, N, nb](int rows, int64_t r0, int64_t n) {
      tile<T>(rows, a, r0, K, d + n * nb, m ? m + n * nb : nullptr, qs + n * nb * T::kQsBytes,
              qh + n * nb * T::kQhBytes, y + r0 * N + n, N);
    });
  });
}

ffi::Error check(const std::string& name, ffi::Span<const int64_t> xd, ffi::Span<const int64_t> dd,
                 ffi::Span<const int64_t> qd, int64_t qs_bytes) {
  if (xd.size() != 2 || dd.size() != 2 || qd.size() != 3 || xd[1] % kBlock != 0 ||
      dd[1] != xd[1] / kBlock || qd[0] != dd[0] || qd[1] != dd[1] || qd[2] != qs_bytes)
    return ffi::Error::InvalidArgument(name + ": expected x[M, K], d[N, K/32] and qs[N, K/32, block bytes]");
  return ffi::Error::Success();
}

ffi::Error check_like_d(const std::string& name, const char* what, ffi::Span<const int64_t> dd,
                        ffi::Span<const int64_t> od, int64_t last) {
  const bool ok = last == 0 ? (od.size() == 2 && od[0] == dd[0] && od[1] == dd[1])
                            : (od.size() == 3 && od[0] == dd[0] && od[1] == dd[1] && od[2] == last);
  if (!ok) return ffi::Error::InvalidArgument(name + ": " + what + " does not match d's [N, K/32]");
  return ffi::Error::Success();
}

// One handler per type; m and qh are empty buffers (unused) for the types without them.
template <typename T>
ffi::Error Run(const char* name, ffi::ThreadPool& pool, ffi::Buffer<ffi::F32>& x, ffi::Buffer<ffi::U16>& d,
               const uint16_t* m, ffi::Span<const int64_t> md, const uint8_t* qh, ffi::Span<const int64_t> hd,
               ffi::Buffer<ffi::U8>& qs, ffi::ResultBuffer<ffi::F32>& y) {
  auto xd = x.dimensions();
  auto dd = d.dimensions();
  if (auto e = check(name, xd, dd, qs.dimensions(), T::kQsBytes); e.failure()) return e;
  if (T::kMin)
    if (auto e = check_like_d(name, "m", dd, md, 0); e.failure()) return e;
  if (T::kQhBytes)
    if (auto e = check_like_d(name, "qh", dd, hd, T::kQhBytes); e.failure()) return e;
  linear<T>(pool, x.typed_data(), d.typed_data(), m, qs.typed_data(), qh, y->typed_data(), xd[0], xd[1], dd[0]);
  return ffi::Error::Success();
}

ffi::Error DotQ8_0(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U16> d, ffi::Buffer<ffi::U8> qs,
                   ffi::ResultBuffer<ffi::F32> y) {
  return Run<Q8_0>("jaxllm_dot_q8_0", pool, x, d, nullptr, {}, nullptr, {}, qs, y);
}

ffi::Error DotQ4_0(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U16> d, ffi::Buffer<ffi::U8> qs,
                   ffi::ResultBuffer<ffi::F32> y) {
  return Run<Q4_0>("jaxllm_dot_q4_0", pool, x, d, nullptr, {}, nullptr, {}, qs, y);
}

ffi::Error DotQ4_1(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U16> d, ffi::Buffer<ffi::U16> m,
                   ffi::Buffer<ffi::U8> qs, ffi::ResultBuffer<ffi::F32> y) {
  return Run<Q4_1>("jaxllm_dot_q4_1", pool, x, d, m.typed_data(), m.dimensions(), nullptr, {}, qs, y);
}

ffi::Error DotQ5_0(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U16> d, ffi::Buffer<ffi::U8> qh,
                   ffi::Buffer<ffi::U8> qs, ffi::ResultBuffer<ffi::F32> y) {
  return Run<Q5_0>("jaxllm_dot_q5_0", pool, x, d, nullptr, {}, qh.typed_data(), qh.dimensions(), qs, y);
}

ffi::Error DotQ5_1(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U16> d, ffi::Buffer<ffi::U16> m,
                   ffi::Buffer<ffi::U8> qh, ffi::Buffer<ffi::U8> qs, ffi::ResultBuffer<ffi::F32> y) {
  return Run<Q5_1>("jaxllm_dot_q5_1", pool, x, d, m.typed_data(), m.dimensions(), qh.typed_data(), qh.dimensions(),
                   qs, y);
}

}  // namespace

// Operands in the order of jaxllm/quant/native_matmul.py: x, d, [m], [qh], qs.
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxllmDotQ8_0, DotQ8_0,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U16>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxllmDotQ4_0, DotQ4_0,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U16>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxllmDotQ4_1, DotQ4_1,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U16>>()
                                  .Arg<ffi::Buffer<ffi::U16>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxllmDotQ5_0, DotQ5_0,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U16>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxllmDotQ5_1, DotQ5_1,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U16>>()
                                  .Arg<ffi::Buffer<ffi::U16>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
