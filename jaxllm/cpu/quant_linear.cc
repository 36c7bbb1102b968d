// Native CPU matmul over GGUF blocks kept packed: y[M, N] = x[M, K] . dequant(w)[N, K]^T,
// float32 accumulation, for Q8_0, Q4_0, Q4_1, Q5_0 and Q5_1 weights split into per-field
// arrays by jaxllm/quant/gguf_blocks.py (d, m: [N, nb] float16 bits; qs: [N, nb, 32 | 16]
// bytes; qh: [N, nb, 4] bytes, the fifth bits of Q5_*; nb = K / 32), and for the K-quants
// Q4_K, Q5_K and Q6_K (256-weight super-blocks, K a multiple of 256; see "K-quants" below).
//
// The weights are never dequantized to memory: each 32-weight block is widened in
// registers (int8 or nibbles [+ fifth bit] -> int32 -> float32), multiplied by x with FMAs
// into a block partial, and the block's scale d (F16C) is applied once per block:
//   Q8_0, Q4_0, Q5_0: y += d * sum(q * x)   (Q4_0, Q5_0: q - 8, q - 16 taken in the bytes,
//                                             so the widened weights are exact integers)
//   Q4_1, Q5_1:       y += d * sum(q * x) + m * sum(x)
// sum(x) per block is computed once per row of x, before the rows of w are split.
// A block, once widened, is reused for up to kMaxRows rows of x; the weight rows are split
// over XLA's intra-op thread pool in contiguous ranges, as in linear.cc.  The 32-weight
// types and the K-quants have a 16-lane AVX-512 variant of their tiles, used where the CPU
// has it; Q4_1 (the built-in model's layers) has its own AVX-512 walk, several weight rows
// per pass over x (see "Q4_1, AVX-512" below), and from 32 rows of x (a prefill) a walk over
// weights widened once per call into float32 panels with the same bits ("Q4_1, AVX-512, a
// prefill's many rows"); Q8_0 (its tied LM head), Q4_0 and Q5_0 have a several-rows walk
// too (see "Q8_0, Q4_0, Q5_0, AVX-512").  Without AVX-512, Q4_1 runs the same kind of walk
// 8 lanes wide below 32 rows ("Q4_1, AVX2") and 8-lane panels from 32 ("Q4_1, AVX2, a
// prefill's many rows"), the other types the one-row tiles.
// Called from jaxllm/cpu/native.py via XLA's FFI.
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <type_traits>
#include <vector>

#include "gguf_simd.h"
#include "parallel.h"
#include "simd.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
using jaxllm_gguf::f16;
using jaxllm_gguf::f16x8;
using jaxllm_gguf::fifth_bits;
using jaxllm_gguf::nibbles;
using jaxllm_gguf::rows_range_prefetched;
using jaxllm_gguf::split_rows;

namespace {

constexpr int64_t kBlock = 32;

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

// One block's 32 weights (without d, m) as four float32 vectors, weights 0..7, ..., 24..31.
// qh: the block's 4 high-bit bytes (Q5_*), unused by the other types.
struct Q8_0 {
  static constexpr int64_t kQsBytes = 32;
  static constexpr int64_t kQhBytes = 0;
  static constexpr bool kSigned = true;
  static inline void bytes(const uint8_t* qs, const uint8_t*, __m128i* lo, __m128i* hi) {
    *lo = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
    *hi = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs + 16));
  }
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
  static constexpr bool kSigned = true;
  static inline void bytes(const uint8_t* qs, const uint8_t*, __m128i* lo, __m128i* hi) {
    nibbles(qs, lo, hi);
    *lo = _mm_sub_epi8(*lo, _mm_set1_epi8(8));
    *hi = _mm_sub_epi8(*hi, _mm_set1_epi8(8));
  }
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
  static constexpr bool kSigned = true;
  static inline void bytes(const uint8_t* qs, const uint8_t* qh, __m128i* lo, __m128i* hi) {
    __m128i hlo, hhi;
    nibbles(qs, lo, hi);
    fifth_bits(qh, &hlo, &hhi);
    *lo = _mm_sub_epi8(_mm_or_si128(*lo, hlo), _mm_set1_epi8(16));
    *hi = _mm_sub_epi8(_mm_or_si128(*hi, hhi), _mm_set1_epi8(16));
  }
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
  static constexpr bool kSigned = false;
  static inline void bytes(const uint8_t* qs, const uint8_t* qh, __m128i* lo, __m128i* hi) {
    __m128i hlo, hhi;
    nibbles(qs, lo, hi);
    fifth_bits(qh, &hlo, &hhi);
    *lo = _mm_or_si128(*lo, hlo);
    *hi = _mm_or_si128(*hi, hhi);
  }
  static inline void widen(const uint8_t* qs, const uint8_t* qh, __m256 q[4]) {
    __m128i lo, hi, hlo, hhi;
    nibbles(qs, &lo, &hi);
    fifth_bits(qh, &hlo, &hhi);
    widen16<false>(_mm_or_si128(lo, hlo), q);
    widen16<false>(_mm_or_si128(hi, hhi), q + 2);
  }
};

// Q4_1: weight d * q + m, q the nibble in 0..15 (byte j: weight j low, weight j + 16 high).
// Its blocks are read by its own walks ("Q4_1, AVX2", "Q4_1, AVX-512"), not by the tiles below.
struct Q4_1 {
  static constexpr int64_t kQsBytes = 16;
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

// ---- Q4_1, AVX2: several weight rows per pass over x ----
//
// The 8-lane path's walk for the built-in model's layers, on CPUs without AVX-512 (AMD Zen 2
// and 3, most laptops).  row_tile above takes one weight row at a time, with a scalar f16 ->
// f32 convert of d and of m and a scalar min term per block: on a Zen 3 core (family 25
// model 1) 3.5-4.5 ns a block, 8.3 ms of a 12.2 ms batch-1 decode step, 8 GB/s where the two
// cores read 27; this walk takes 1.9-2.1 ns (docs/BENCHMARKS.md, "The Q4_1 kernel on AVX2").
// As "Q4_1, AVX-512" below: NR weight rows per pass for a tile of MR rows of x, so the
// MR x NR accumulator chains are independent and each x block serves NR rows (read by the
// FMAs from L1: 16 ymm registers hold no x tile); d and m converted 8 blocks at a time (one
// vcvtph2ps each); a block's bytes 0..7 and 8..15 zero-extended to int32 lanes, whose low 4
// bits are weights 0..7 (8..15) and whose bits 4..7 are weights 16..23 (24..31).
//
// For each (row of x, weight row) pair the operations and their order are the same whatever
// MR and NR are (acc and s hold that pair's lanes alone), so a row's result does not depend on
// M or on which rows share the call:
//   per chunk c of 8 blocks:  acc = fma(m[c], sx[c], acc) lane by lane (lanes past nb: +0 * +0)
//   then per block b of it:   s   = q[0..7] * x[0..7];  s = fma(q[16..23], x[16..23], s)
//                             s   = fma(q[8..15], x[8..15], s);  s = fma(q[24..31], x[24..31], s)
//                             acc = fma(d_b, s, acc)
//   y = hsum(acc)
using jaxllm_gguf::kChunk8;        // blocks whose d and m are converted at once
constexpr int64_t kAhead8 = 8;    // weight rows ahead whose fields are prefetched (as kAhead below)

template <int MR, int NR>
void q4_1_tile_256(const float* x, int64_t K, const uint16_t* d, const uint16_t* m, const uint8_t* qs,
                   const float* sx, float* y, int64_t N) {
  const int64_t nb = K / kBlock;
  const __m256i low4 = _mm256_set1_epi32(15);
  // a block's bytes 0..7 (8..15), in both 128-bit halves, to int32 lanes 0..7: vpshufb within
  // each half, where vpmovzxbd crosses halves (1.5 cycles a ymm against vpshufb's 0.5 in
  // llvm-mca's Zen 3 model)
  const __m256i bytes0_7 = _mm256_setr_epi8(0, -1, -1, -1, 1, -1, -1, -1, 2, -1, -1, -1, 3, -1, -1, -1,
                                            4, -1, -1, -1, 5, -1, -1, -1, 6, -1, -1, -1, 7, -1, -1, -1);
  const __m256i bytes8_15 = _mm256_add_epi32(bytes0_7, _mm256_set1_epi32(8));
  __m256 acc[MR][NR];
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NR; ++j) acc[r][j] = _mm256_setzero_ps();
  alignas(32) float db[NR][kChunk8];   // this chunk's d as float32, per weight row
  for (int64_t c0 = 0; c0 < nb; c0 += kChunk8) {
    const int64_t cn = std::min<int64_t>(kChunk8, nb - c0);
    const __m256i lanes = jaxllm_gguf::chunk_lanes(cn);
    const __m256 lanes_ps = _mm256_castsi256_ps(lanes);
#pragma GCC unroll 4
    for (int j = 0; j < NR; ++j) {
      _mm256_store_ps(db[j], f16x8(d + j * nb, nb, c0, cn, lanes_ps));
      const __m256 mv = f16x8(m + j * nb, nb, c0, cn, lanes_ps);
#pragma GCC unroll 4
      for (int r = 0; r < MR; ++r)
        acc[r][j] = _mm256_fmadd_ps(mv, _mm256_maskload_ps(sx + r * nb + c0, lanes), acc[r][j]);
    }
    jaxllm_gguf::prefetch_q4_1_scales<NR>(d, m, nb, c0, kAhead8);
    for (int64_t i = 0; i < cn; ++i) {
      const int64_t b = c0 + i;
      jaxllm_gguf::prefetch_q4_1_quants<NR>(qs, nb, b, kAhead8);
      const float* xb = x + b * kBlock;
      __m256 s[MR][NR];
#pragma GCC unroll 4
      for (int j = 0; j < NR; ++j) {
        const uint8_t* qb = qs + (j * nb + b) * Q4_1::kQsBytes;
        const __m256i v = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qb)));
        const __m256i v0 = _mm256_shuffle_epi8(v, bytes0_7), v1 = _mm256_shuffle_epi8(v, bytes8_15);
        const __m256 q0 = _mm256_cvtepi32_ps(_mm256_and_si256(v0, low4));    // weights 0..7
        const __m256 q16 = _mm256_cvtepi32_ps(_mm256_srli_epi32(v0, 4));     // 16..23
        const __m256 q8 = _mm256_cvtepi32_ps(_mm256_and_si256(v1, low4));    // 8..15
        const __m256 q24 = _mm256_cvtepi32_ps(_mm256_srli_epi32(v1, 4));     // 24..31
#pragma GCC unroll 4
        for (int r = 0; r < MR; ++r) {
          const float* xr = xb + r * K;
          __m256 t = _mm256_mul_ps(q0, _mm256_loadu_ps(xr));
          t = _mm256_fmadd_ps(q16, _mm256_loadu_ps(xr + 16), t);
          t = _mm256_fmadd_ps(q8, _mm256_loadu_ps(xr + 8), t);
          s[r][j] = _mm256_fmadd_ps(q24, _mm256_loadu_ps(xr + 24), t);
        }
      }
#pragma GCC unroll 4
      for (int j = 0; j < NR; ++j) {
        const __m256 dj = _mm256_broadcast_ss(&db[j][i]);
#pragma GCC unroll 4
        for (int r = 0; r < MR; ++r) acc[r][j] = _mm256_fmadd_ps(dj, s[r][j], acc[r][j]);
      }
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NR; ++j) y[r * N + j] = jaxllm_simd::hsum(acc[r][j]);
}

// Weight rows per pass for a tile of MR rows of x: 2 * MR * NR accumulators and partials + a
// block's 4 weight vectors + constants within the 16 ymm registers.
template <int MR>
constexpr int kRowsPerPass8 = MR == 1 ? 4 : MR == 2 ? 2 : 1;

// The weight rows [n0, n1) against a tile of MR rows of x, NR at a time (the last < NR one
// by one); the first kAhead8 rows of the part requested as it starts.
template <int MR>
void q4_1_rows_256(const float* x, int64_t K, const uint16_t* d, const uint16_t* m, const uint8_t* qs,
                   const float* sx, float* y, int64_t N, int64_t n0, int64_t n1) {
  constexpr int NR = kRowsPerPass8<MR>;
  const int64_t nb = K / kBlock;
  jaxllm_gguf::prefetch_q4_1_rows(d, m, qs, nb, n0, std::min(n1, n0 + kAhead8) - n0);
  int64_t n = n0;
  for (; n + NR <= n1; n += NR)
    q4_1_tile_256<MR, NR>(x, K, d + n * nb, m + n * nb, qs + n * nb * Q4_1::kQsBytes, sx, y + n, N);
  for (; n < n1; ++n)
    q4_1_tile_256<MR, 1>(x, K, d + n * nb, m + n * nb, qs + n * nb * Q4_1::kQsBytes, sx, y + n, N);
}

// The walk's entry for linear_q4_1_walk below.
struct Q4_1Rows256 {
  template <int MR>
  static void run(const float* x, int64_t K, const uint16_t* d, const uint16_t* m, const uint8_t* qs,
                  const float* sx, float* y, int64_t N, int64_t n0, int64_t n1) {
    q4_1_rows_256<MR>(x, K, d, m, qs, sx, y, N, n0, n1);
  }
};

// ---- AVX-512: the same tiles 16 lanes wide, chosen at run time ----
//
// A block's weights 0..15 and 16..31 (T::bytes) widen to two 16-lane vectors: half the
// converts and FMAs of the 8-lane path, which at batch 1 is bound by them rather than by
// the weight bytes.  Used when the CPU has AVX512F/BW (use_avx512(), overridable by
// jaxllm_quant_linear_set_avx512 so that the tests run both paths on one machine).
#define JAXLLM_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")))

bool detect_avx512() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");
}
const bool kHasAvx512 = detect_avx512();
bool g_avx512 = kHasAvx512;

template <bool Signed>
JAXLLM_AVX512 inline __m512 widen16_512(__m128i v) {
  return _mm512_cvtepi32_ps(Signed ? _mm512_cvtepi8_epi32(v) : _mm512_cvtepu8_epi32(v));
}

template <int MR, typename T>
JAXLLM_AVX512 void row_tile_512(const float* x, int64_t K, const uint16_t* d, const uint16_t* m, const uint8_t* qs,
                                const uint8_t* qh, const float* sx, float* y, int64_t N) {
  const int64_t nb = K / kBlock;
  __m512 acc[MR];
  float macc[MR];
  for (int r = 0; r < MR; ++r) {
    acc[r] = _mm512_setzero_ps();
    macc[r] = 0.0f;
  }
  for (int64_t b = 0; b < nb; ++b) {
    __m128i lo, hi;
    T::bytes(qs + b * T::kQsBytes, qh + b * T::kQhBytes, &lo, &hi);
    const __m512 q0 = widen16_512<T::kSigned>(lo), q1 = widen16_512<T::kSigned>(hi);
    const __m512 db = _mm512_set1_ps(f16(d[b]));
    const float* xb = x + b * kBlock;
#pragma GCC unroll 4
    for (int r = 0; r < MR; ++r) {
      const float* xr = xb + r * K;
      const __m512 s = _mm512_fmadd_ps(q1, _mm512_loadu_ps(xr + 16), _mm512_mul_ps(q0, _mm512_loadu_ps(xr)));
      acc[r] = _mm512_fmadd_ps(db, s, acc[r]);
    }
    if (m != nullptr) {
      const float mb = f16(m[b]);
#pragma GCC unroll 4
      for (int r = 0; r < MR; ++r) macc[r] += mb * sx[r * nb + b];
    }
  }
  for (int r = 0; r < MR; ++r) y[r * N] = _mm512_reduce_add_ps(acc[r]) + macc[r];
}

template <typename T>
JAXLLM_AVX512 void tile_512(int rows, const float* x, int64_t K, const uint16_t* d, const uint16_t* m,
                            const uint8_t* qs, const uint8_t* qh, const float* sx, float* y, int64_t N) {
  switch (rows) {
    case 1: row_tile_512<1, T>(x, K, d, m, qs, qh, sx, y, N); break;
    case 2: row_tile_512<2, T>(x, K, d, m, qs, qh, sx, y, N); break;
    case 3: row_tile_512<3, T>(x, K, d, m, qs, qh, sx, y, N); break;
    default: row_tile_512<4, T>(x, K, d, m, qs, qh, sx, y, N); break;
  }
}

// ---- Q4_1, AVX-512: several weight rows per pass over x ----
//
// Batch-1 decode spends most of its time here (the built-in model's projections are Q4_1),
// and the generic 16-lane tile above was bound by its instruction stream, not the weight
// bytes: one weight row at a time, a scalar f16 -> f32 convert of d and m per block, and at
// M = 1 one FMA chain (acc += d * s) per row, each block waiting on the last.  This walk
// takes NR weight rows at a time for a tile of MR rows of x, so the MR x NR accumulator
// chains are independent and each x block, loaded once, serves NR rows; d and m are
// converted 16 blocks at a time (one vcvtph2ps each); a block's 16 bytes widen once to 16
// int32 lanes (byte j -> lane j), whose low 4 bits pick weight j's d * q from a 16-entry
// table d_b * (0..15) (vpermps uses only an index's low 4 bits) and whose bits 4..7, shifted
// down, pick weight j + 16's.  d * q is exact in float32 (11 significant bits times 4), so
// the table holds the dequantized weights without rounding, and a pair takes two FMAs a
// block, not a multiply and two FMAs: the prefill panels below, which hold d * q, do two
// vector ops per 32 multiply-adds instead of three (1.16-1.24x a 512-row call on an AVX-512
// Xeon; the batch-1 step's calls 0.93-1.00x, both FMAs now on the accumulator's chain, and
// decode end to end 0.98-1.01x: docs/BENCHMARKS.md, "d * q: two FMAs a block").  On the
// 2-core EPYC here (Zen 4, family 25 model 17: 512-bit ops in two halves)
// the loop is bound by its vector ops: 1.5x the old tile's weight bytes per second on one
// core (docs/BENCHMARKS.md, "The Q4_1 kernel").
//
// For each (row of x, weight row) pair the operations and their order are the same whatever
// MR and NR are (acc holds that pair's lanes alone), so a row's result does not depend on
// M or on which rows share the call:
//   acc  = over blocks b, in order:  acc = fma(dq_hi(b), x_hi(b), fma(dq_lo(b), x_lo(b), acc))
//   acc += m[c] * sx[c] lane by lane before each 16 blocks c (the min term: m_b * sum(x_b))
//   y    = reduce_add(acc)
constexpr int64_t kChunk = 16;   // blocks whose d and m are converted at once
// Weight rows ahead whose fields are prefetched, a cache line of each row every 4 blocks
// (as the tile reaches the same place in its own rows): requesting a whole row group's
// lines at once, as rows_range_prefetched does row by row, left the K = 1536 projection
// 1.3x slower than the old tile when its weights came from L3 (4 rows' lines in a burst).
constexpr int64_t kAhead = 8;

template <int MR, int NR>
JAXLLM_AVX512 void q4_1_tile_512(const float* x, int64_t K, const uint16_t* d, const uint16_t* m,
                                 const uint8_t* qs, const float* sx, float* y, int64_t N) {
  const int64_t nb = K / kBlock;
  const __m512 table = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  __m512 acc[MR][NR];
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NR; ++j) acc[r][j] = _mm512_setzero_ps();
  alignas(64) float db[NR][kChunk];   // this chunk's d as float32, per weight row
  for (int64_t c0 = 0; c0 < nb; c0 += kChunk) {
    const int64_t cn = std::min<int64_t>(kChunk, nb - c0);
    const __mmask16 lanes = static_cast<__mmask16>((1u << cn) - 1);
    // the min term of these blocks, lanes past nb zero: m (masked f16 load) * sum(x)
#pragma GCC unroll 4
    for (int j = 0; j < NR; ++j) {
      const __m512 dv = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(lanes, d + j * nb + c0));
      _mm512_store_ps(db[j], dv);
      const __m512 mv = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(lanes, m + j * nb + c0));
#pragma GCC unroll 4
      for (int r = 0; r < MR; ++r)
        acc[r][j] = _mm512_fmadd_ps(mv, _mm512_maskz_loadu_ps(lanes, sx + r * nb + c0), acc[r][j]);
    }
#pragma GCC unroll 4
    for (int j = 0; j < NR; ++j) {   // the same chunk of the row kAhead rows on
      _mm_prefetch(reinterpret_cast<const char*>(d + (j + kAhead) * nb + c0), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(m + (j + kAhead) * nb + c0), _MM_HINT_T0);
    }
    for (int64_t i = 0; i < cn; ++i) {
      const int64_t b = c0 + i;
      if (b % 4 == 0) {   // a cache line of qs is 4 blocks
#pragma GCC unroll 4
        for (int j = 0; j < NR; ++j)
          _mm_prefetch(reinterpret_cast<const char*>(qs + ((j + kAhead) * nb + b) * Q4_1::kQsBytes), _MM_HINT_T0);
      }
      __m512 xlo[MR], xhi[MR];
#pragma GCC unroll 4
      for (int r = 0; r < MR; ++r) {
        xlo[r] = _mm512_loadu_ps(x + r * K + b * kBlock);
        xhi[r] = _mm512_loadu_ps(x + r * K + b * kBlock + 16);
      }
#pragma GCC unroll 4
      for (int j = 0; j < NR; ++j) {
        const __m512i v = _mm512_cvtepu8_epi32(
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs + (j * nb + b) * Q4_1::kQsBytes)));
        const __m512 dtable = _mm512_mul_ps(_mm512_set1_ps(db[j][i]), table);
        const __m512 qlo = _mm512_permutexvar_ps(v, dtable);
        const __m512 qhi = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), dtable);
#pragma GCC unroll 4
        for (int r = 0; r < MR; ++r)
          acc[r][j] = _mm512_fmadd_ps(qhi, xhi[r], _mm512_fmadd_ps(qlo, xlo[r], acc[r][j]));
      }
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NR; ++j) y[r * N + j] = _mm512_reduce_add_ps(acc[r][j]);
}

// Weight rows per pass for a tile of MR rows of x: MR * NR accumulators + 2 * MR x vectors
// + 2 * NR weight vectors stay within the 32 zmm registers.
template <int MR>
constexpr int kRowsPerPass = MR <= 2 ? 4 : 2;

// The weight rows [n0, n1) against a tile of MR rows of x, NR at a time (the last < NR one
// by one).  The tiles prefetch kAhead rows on; the first kAhead rows of the part are
// requested here, as it starts (else every call would begin on a cold stream, see
// gguf_simd.h's rows_range_prefetched).
template <int MR>
JAXLLM_AVX512 void q4_1_rows_512(const float* x, int64_t K, const uint16_t* d, const uint16_t* m,
                                 const uint8_t* qs, const float* sx, float* y, int64_t N, int64_t n0, int64_t n1) {
  constexpr int NR = kRowsPerPass<MR>;
  const int64_t nb = K / kBlock;
  const int64_t first = std::min(n1, n0 + kAhead) - n0;
  jaxllm_gguf::prefetch(qs + n0 * nb * Q4_1::kQsBytes, first * nb * Q4_1::kQsBytes);
  jaxllm_gguf::prefetch(d + n0 * nb, first * nb * 2);
  jaxllm_gguf::prefetch(m + n0 * nb, first * nb * 2);
  int64_t n = n0;
  for (; n + NR <= n1; n += NR) {
    q4_1_tile_512<MR, NR>(x, K, d + n * nb, m + n * nb, qs + n * nb * Q4_1::kQsBytes, sx, y + n, N);
  }
  for (; n < n1; ++n)
    q4_1_tile_512<MR, 1>(x, K, d + n * nb, m + n * nb, qs + n * nb * Q4_1::kQsBytes, sx, y + n, N);
}

// ---- Q4_1, AVX-512, a prefill's many rows: the weights widened once per call ----
//
// q4_1_tile_512 widens each block's nibbles to floats in registers (a load, a zero-extend, a
// multiply of the table by d, two table shuffles and a shift per weight row and block) for a
// tile of at most 4 rows of x: at a prefill chunk's 512 rows that widening is redone 128
// times per weight and keeps the vector ports busier than the arithmetic.  From
// kPanelMinRows rows on, a call widens each part's weight rows once into float32 panels
// (q: [rows, nb, 32] d * q of weights 0..15 then 16..31 of each block, m: [rows, nbp]
// floats, nbp = nb rounded up to kChunk, zeros past nb; no d panel: kScalePanel false)
// and runs 4 x 4 tiles whose weights are plain loads.  The arithmetic of each (row of x,
// weight row) pair is q4_1_tile_512's, operation for operation and in its order (the same
// float values: d * q exact either way, m the same f16 -> f32 converts; the min term's lanes
// past nb add fma(+0, +0, acc) as the masked loads there do), so a row's result is the same
// bits as in a decode step's 1-row call (tests/kernels/test_cpu_quant_linear.py).
constexpr int64_t kPanelMinRows = 32;
constexpr int64_t kPanelRows = 64;   // weight rows widened at once (L2: 64 x K x 4 bytes)
constexpr int kPanelMR = 4, kPanelNR = 4;   // 16 accumulators + 8 x vectors + q in 32 zmm
                                            // (6 x 2, 5 x 3, 8 x 2 measured 0.82-0.85x of it)

// 16 horizontal sums at once: lane k of the result is a[k]'s 16 lanes added in
// _mm512_reduce_add_ps's tree (lanes i + i + 8, then + 4, + 2, + 1; a + b is b + a bit for
// bit), so each sum is the same bits as that call's, in 46 vector ops where 16 calls take
// ~130 (a 4 x 4 panel tile spent about a sixth of its ops on them at K = 576).
JAXLLM_AVX512 inline __m512 reduce_add_16(const __m512 a[16]) {
  __m512 h[8], q[4], e[2];
  for (int k = 0; k < 8; ++k)   // [a[2k] lanes i + i+8 | a[2k+1]'s], 8 lanes each
    h[k] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * k], a[2 * k + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_f32x4(a[2 * k], a[2 * k + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  for (int k = 0; k < 4; ++k)   // 128-bit lane g: a[4k + g]'s i + i+4, 4 lanes each
    q[k] = _mm512_add_ps(_mm512_shuffle_f32x4(h[2 * k], h[2 * k + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(h[2 * k], h[2 * k + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  for (int k = 0; k < 2; ++k)   // lane g: [a[8k + g]'s 0+2, 1+3, a[8k + 4 + g]'s 0+2, 1+3]
    e[k] = _mm512_add_ps(_mm512_shuffle_ps(q[2 * k], q[2 * k + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(q[2 * k], q[2 * k + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  // lane 4g + c: a[g + 4c]'s (0+2) + (1+3); then lane k: a[k]'s
  const __m512 t = _mm512_add_ps(_mm512_shuffle_ps(e[0], e[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm512_shuffle_ps(e[0], e[1], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), t);
}

template <int MR, int NR>
JAXLLM_AVX512 void q4_1_panel_tile_512(const float* x, int64_t K, const float* q, const float* mp,
                                       int64_t nbp, const float* sx, float* y, int64_t N) {
  const int64_t nb = K / kBlock;
  __m512 acc[MR][NR];
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NR; ++j) acc[r][j] = _mm512_setzero_ps();
  for (int64_t c0 = 0; c0 < nb; c0 += kChunk) {
    const int64_t cn = std::min<int64_t>(kChunk, nb - c0);
    const __mmask16 lanes = static_cast<__mmask16>((1u << cn) - 1);
#pragma GCC unroll 4
    for (int j = 0; j < NR; ++j) {
      const __m512 mv = _mm512_loadu_ps(mp + j * nbp + c0);
#pragma GCC unroll 4
      for (int r = 0; r < MR; ++r)
        acc[r][j] = _mm512_fmadd_ps(mv, _mm512_maskz_loadu_ps(lanes, sx + r * nb + c0), acc[r][j]);
    }
    for (int64_t i = 0; i < cn; ++i) {
      const int64_t b = c0 + i;
      __m512 xlo[MR], xhi[MR];
#pragma GCC unroll 4
      for (int r = 0; r < MR; ++r) {
        xlo[r] = _mm512_loadu_ps(x + r * K + b * kBlock);
        xhi[r] = _mm512_loadu_ps(x + r * K + b * kBlock + 16);
      }
#pragma GCC unroll 4
      for (int j = 0; j < NR; ++j) {
        const float* qb = q + (j * nb + b) * kBlock;
        const __m512 qlo = _mm512_loadu_ps(qb), qhi = _mm512_loadu_ps(qb + 16);
#pragma GCC unroll 4
        for (int r = 0; r < MR; ++r)
          acc[r][j] = _mm512_fmadd_ps(qhi, xhi[r], _mm512_fmadd_ps(qlo, xlo[r], acc[r][j]));
      }
    }
  }
  if constexpr (MR == 4 && NR == 4) {
    alignas(64) float sums[16];
    _mm512_store_ps(sums, reduce_add_16(&acc[0][0]));
    for (int r = 0; r < MR; ++r)
      for (int j = 0; j < NR; ++j) y[r * N + j] = sums[r * NR + j];
    return;
  }
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NR; ++j) y[r * N + j] = _mm512_reduce_add_ps(acc[r][j]);
}

// The panel's rows [0, pn) against a tile of MR rows of x, kPanelNR at a time (the last
// < kPanelNR one by one).
template <int MR>
JAXLLM_AVX512 void q4_1_panel_rows_512(const float* x, int64_t K, const float* q, const float* mp,
                                       int64_t nbp, const float* sx, float* y, int64_t N, int64_t pn) {
  const int64_t nb = K / kBlock;
  int64_t j = 0;
  for (; j + kPanelNR <= pn; j += kPanelNR)
    q4_1_panel_tile_512<MR, kPanelNR>(x, K, q + j * nb * kBlock, mp + j * nbp, nbp, sx, y + j, N);
  for (; j < pn; ++j)
    q4_1_panel_tile_512<MR, 1>(x, K, q + j * nb * kBlock, mp + j * nbp, nbp, sx, y + j, N);
}

// Weight rows [n0, n0 + pn) widened into the panels (layout above).
JAXLLM_AVX512 void q4_1_widen_panel_512(const uint16_t* d, const uint16_t* m, const uint8_t* qs, int64_t nb,
                                        int64_t nbp, int64_t n0, int64_t pn, float* q, float* mp) {
  const __m512i low4 = _mm512_set1_epi32(15);
  for (int64_t j = 0; j < pn; ++j) {
    const int64_t n = n0 + j;
    for (int64_t b = 0; b < nb; ++b) {
      const __m512i v = _mm512_cvtepu8_epi32(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs + (n * nb + b) * Q4_1::kQsBytes)));
      float* qb = q + (j * nb + b) * kBlock;
      const __m512 db = _mm512_set1_ps(_cvtsh_ss(d[n * nb + b]));   // the walk's d_b, the same convert
      _mm512_storeu_ps(qb, _mm512_mul_ps(db, _mm512_cvtepi32_ps(_mm512_and_si512(v, low4))));
      _mm512_storeu_ps(qb + 16, _mm512_mul_ps(db, _mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4))));
    }
    for (int64_t c0 = 0; c0 < nbp; c0 += kChunk) {
      const int64_t cn = std::max<int64_t>(0, std::min<int64_t>(kChunk, nb - c0));
      const __mmask16 lanes = static_cast<__mmask16>((1u << cn) - 1);
      _mm512_storeu_ps(mp + j * nbp + c0, _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(lanes, m + n * nb + c0)));
    }
  }
}

// The AVX-512 panels' entry for linear_q4_1_panels below.
struct Q4_1Panels512 {
  static constexpr int64_t kChunkBlocks = kChunk;
  static constexpr bool kScalePanel = false;   // d is in the q panel (d * q)
  static constexpr int kMR = kPanelMR;
  JAXLLM_AVX512 static void widen(const uint16_t* d, const uint16_t* m, const uint8_t* qs, int64_t nb, int64_t nbp,
                                  int64_t n0, int64_t pn, float* q, float* dp, float* mp) {
    q4_1_widen_panel_512(d, m, qs, nb, nbp, n0, pn, q, mp);
  }
  template <int MR>
  JAXLLM_AVX512 static void rows(const float* x, int64_t K, const float* q, const float* dp, const float* mp,
                                 int64_t nbp, const float* sx, float* y, int64_t N, int64_t pn) {
    q4_1_panel_rows_512<MR>(x, K, q, mp, nbp, sx, y, N, pn);
  }
};

// ---- Q4_1, AVX2, a prefill's many rows: the weights widened once per call ----
//
// The AVX2 walk above takes one weight row per pass for a tile of 3-4 rows of x, so a
// prefill chunk widens each block (load, two table shuffles, two masks, two shifts, four
// converts) once per 4 rows of x: 128 times at 512 rows, as many vector operations as the
// tile's 5 FMAs per block and pair.  From kPanelMinRows rows on, each part's weight rows
// are widened once into float32 panels (q: [rows, nb, 32] weights in order, d and m:
// [rows, nbp] floats, nbp = nb rounded up to kChunk8, +0 past nb) and 4 x 2 tiles of (rows
// of x, weight rows) run on plain loads.  Each pair's operations and their order are
// q4_1_tile_256's: per chunk fma(m, sx, acc) (+0 * +0 past nb: the panel's zeros, the masked
// load's), then per block s = q0 * x0, fma q16, fma q8, fma q24, acc = fma(d, s, acc); the
// panel holds the same float values (the nibbles are small exact integers, d and m the same
// f16 -> f32 converts), so a row's result is the same bits as in a decode step's 1-row call
// (tests/kernels/test_cpu_quant_linear.py).
constexpr int kPanelMR8 = 4, kPanelNR8 = 2;   // 8 accumulators + a row's 4 weight vectors, d, s in 16 ymm

template <int MR, int NR>
void q4_1_panel_tile_256(const float* x, int64_t K, const float* q, const float* dp, const float* mp, int64_t nbp,
                         const float* sx, float* y, int64_t N) {
  const int64_t nb = K / kBlock;
  __m256 acc[MR][NR];
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NR; ++j) acc[r][j] = _mm256_setzero_ps();
  for (int64_t c0 = 0; c0 < nb; c0 += kChunk8) {
    const int64_t cn = std::min<int64_t>(kChunk8, nb - c0);
    const __m256i lanes = jaxllm_gguf::chunk_lanes(cn);
#pragma GCC unroll 4
    for (int j = 0; j < NR; ++j) {
      const __m256 mv = _mm256_loadu_ps(mp + j * nbp + c0);
#pragma GCC unroll 4
      for (int r = 0; r < MR; ++r)
        acc[r][j] = _mm256_fmadd_ps(mv, _mm256_maskload_ps(sx + r * nb + c0, lanes), acc[r][j]);
    }
    for (int64_t i = 0; i < cn; ++i) {
      const int64_t b = c0 + i;
#pragma GCC unroll 4
      for (int j = 0; j < NR; ++j) {
        const float* qb = q + (j * nb + b) * kBlock;
        const __m256 q0 = _mm256_loadu_ps(qb), q8 = _mm256_loadu_ps(qb + 8);
        const __m256 q16 = _mm256_loadu_ps(qb + 16), q24 = _mm256_loadu_ps(qb + 24);
        const __m256 dj = _mm256_broadcast_ss(dp + j * nbp + b);
#pragma GCC unroll 4
        for (int r = 0; r < MR; ++r) {
          const float* xr = x + r * K + b * kBlock;
          __m256 t = _mm256_mul_ps(q0, _mm256_loadu_ps(xr));
          t = _mm256_fmadd_ps(q16, _mm256_loadu_ps(xr + 16), t);
          t = _mm256_fmadd_ps(q8, _mm256_loadu_ps(xr + 8), t);
          t = _mm256_fmadd_ps(q24, _mm256_loadu_ps(xr + 24), t);
          acc[r][j] = _mm256_fmadd_ps(dj, t, acc[r][j]);
        }
      }
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NR; ++j) y[r * N + j] = jaxllm_simd::hsum(acc[r][j]);
}

// The panel's rows [0, pn) against a tile of MR rows of x, kPanelNR8 at a time (the last one alone).
template <int MR>
void q4_1_panel_rows_256(const float* x, int64_t K, const float* q, const float* dp, const float* mp, int64_t nbp,
                         const float* sx, float* y, int64_t N, int64_t pn) {
  const int64_t nb = K / kBlock;
  int64_t j = 0;
  for (; j + kPanelNR8 <= pn; j += kPanelNR8)
    q4_1_panel_tile_256<MR, kPanelNR8>(x, K, q + j * nb * kBlock, dp + j * nbp, mp + j * nbp, nbp, sx, y + j, N);
  for (; j < pn; ++j)
    q4_1_panel_tile_256<MR, 1>(x, K, q + j * nb * kBlock, dp + j * nbp, mp + j * nbp, nbp, sx, y + j, N);
}

// Weight rows [n0, n0 + pn) widened into the panels (layout above).
void q4_1_widen_panel_256(const uint16_t* d, const uint16_t* m, const uint8_t* qs, int64_t nb, int64_t nbp,
                          int64_t n0, int64_t pn, float* q, float* dp, float* mp) {
  const __m256i low4 = _mm256_set1_epi32(15);
  const __m256 all = _mm256_castsi256_ps(_mm256_set1_epi32(-1));
  for (int64_t j = 0; j < pn; ++j) {
    const int64_t n = n0 + j;
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* qb = qs + (n * nb + b) * Q4_1::kQsBytes;
      const __m256i v0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(qb)));
      const __m256i v1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(qb + 8)));
      float* out = q + (j * nb + b) * kBlock;
      _mm256_storeu_ps(out, _mm256_cvtepi32_ps(_mm256_and_si256(v0, low4)));        // weights 0..7
      _mm256_storeu_ps(out + 8, _mm256_cvtepi32_ps(_mm256_and_si256(v1, low4)));    // 8..15
      _mm256_storeu_ps(out + 16, _mm256_cvtepi32_ps(_mm256_srli_epi32(v0, 4)));     // 16..23
      _mm256_storeu_ps(out + 24, _mm256_cvtepi32_ps(_mm256_srli_epi32(v1, 4)));     // 24..31
    }
    for (int64_t c0 = 0; c0 < nbp; c0 += kChunk8) {
      const int64_t cn = std::min<int64_t>(kChunk8, nb - c0);   // >= 1: nbp < nb + kChunk8
      const __m256 lanes = cn == kChunk8 ? all
          : _mm256_castsi256_ps(jaxllm_gguf::chunk_lanes(cn));
      _mm256_storeu_ps(dp + j * nbp + c0, f16x8(d + n * nb, nb, c0, cn, lanes));
      _mm256_storeu_ps(mp + j * nbp + c0, f16x8(m + n * nb, nb, c0, cn, lanes));
    }
  }
}

// The AVX2 panels' entry for linear_q4_1_panels below.
struct Q4_1Panels256 {
  static constexpr int64_t kChunkBlocks = kChunk8;
  static constexpr bool kScalePanel = true;
  static constexpr int kMR = kPanelMR8;
  static void widen(const uint16_t* d, const uint16_t* m, const uint8_t* qs, int64_t nb, int64_t nbp, int64_t n0,
                    int64_t pn, float* q, float* dp, float* mp) {
    q4_1_widen_panel_256(d, m, qs, nb, nbp, n0, pn, q, dp, mp);
  }
  template <int MR>
  static void rows(const float* x, int64_t K, const float* q, const float* dp, const float* mp, int64_t nbp,
                   const float* sx, float* y, int64_t N, int64_t pn) {
    q4_1_panel_rows_256<MR>(x, K, q, dp, mp, nbp, sx, y, N, pn);
  }
};

// y = x . W^T for Q4_1 weights, M >= kPanelMinRows (Panels: Q4_1Panels512 on the AVX-512
// path, Q4_1Panels256 on the AVX2 one): the weight rows split over the pool as in linear();
// each part widens kPanelRows weight rows at a time and walks every tile of x (kMR rows;
// the last tile 1-3) over them.
template <typename Panels>
void linear_q4_1_panels(ffi::ThreadPool& pool, const float* x, const uint16_t* d, const uint16_t* m,
                        const uint8_t* qs, const float* sx, float* y, int64_t M, int64_t K, int64_t N) {
  constexpr int MR = Panels::kMR;
  const int64_t nb = K / kBlock;
  const int64_t nbp = (nb + Panels::kChunkBlocks - 1) / Panels::kChunkBlocks * Panels::kChunkBlocks;
  split_rows(pool, M, N, [=](int64_t n0, int64_t n1) {
    const int64_t rows = std::min<int64_t>(kPanelRows, n1 - n0);
    jaxllm_simd::LineVector<float> q(rows * nb * kBlock), mp(rows * nbp);
    jaxllm_simd::LineVector<float> dp(Panels::kScalePanel ? rows * nbp : 0);   // d panel: only where q is not d * q
    for (int64_t p0 = n0; p0 < n1; p0 += kPanelRows) {
      const int64_t pn = std::min<int64_t>(kPanelRows, n1 - p0);
      Panels::widen(d, m, qs, nb, nbp, p0, pn, q.data(), dp.data(), mp.data());
      for (int64_t r0 = 0; r0 < M; r0 += MR) {
        const float* xt = x + r0 * K;
        const float* st = sx + r0 * nb;
        float* yt = y + r0 * N + p0;
        switch (std::min<int64_t>(MR, M - r0)) {
          case 1: Panels::template rows<1>(xt, K, q.data(), dp.data(), mp.data(), nbp, st, yt, N, pn); break;
          case 2: Panels::template rows<2>(xt, K, q.data(), dp.data(), mp.data(), nbp, st, yt, N, pn); break;
          case 3: Panels::template rows<3>(xt, K, q.data(), dp.data(), mp.data(), nbp, st, yt, N, pn); break;
          default: Panels::template rows<MR>(xt, K, q.data(), dp.data(), mp.data(), nbp, st, yt, N, pn); break;
        }
      }
    }
  });
}

// ---- Q8_0, Q4_0, Q5_0, AVX-512: several weight rows per pass over x ----
//
// The same walk as Q4_1's above for the types without a min (the built-in model's tied LM
// head is Q8_0: 28.7 MiB, 49152 rows, read once per decode step): NR weight rows per pass,
// so at M = 1 the NR accumulator chains are independent and each x block, loaded once,
// serves NR rows; d converted 16 blocks at a time.  Per (row of x, weight row) pair the
// operations and their order are tile_512's (so the bits are the same as that tile's, and
// the same whatever M is and whichever rows share the call):
//   acc = sum over blocks b, in order:  fma(d_b, q_hi(b) * x_hi(b) + q_lo(b) * x_lo(b), acc)
//   y   = reduce_add(acc) + 0
template <typename T, int MR, int NR>
JAXLLM_AVX512 void nomin_tile_512(const float* x, int64_t K, const uint16_t* d, const uint8_t* qs,
                                  const uint8_t* qh, float* y, int64_t N) {
  const int64_t nb = K / kBlock;
  constexpr int64_t kLineBlocks = 64 / T::kQsBytes;   // blocks of qs per cache line
  __m512 acc[MR][NR];
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NR; ++j) acc[r][j] = _mm512_setzero_ps();
  alignas(64) float db[NR][kChunk];   // this chunk's d as float32, per weight row
  for (int64_t c0 = 0; c0 < nb; c0 += kChunk) {
    const int64_t cn = std::min<int64_t>(kChunk, nb - c0);
    const __mmask16 lanes = static_cast<__mmask16>((1u << cn) - 1);
#pragma GCC unroll 4
    for (int j = 0; j < NR; ++j) {
      _mm512_store_ps(db[j], _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(lanes, d + j * nb + c0)));
      _mm_prefetch(reinterpret_cast<const char*>(d + (j + kAhead) * nb + c0), _MM_HINT_T0);
      if (T::kQhBytes)   // a chunk's qh is at most one line (16 blocks x 4 bytes)
        _mm_prefetch(reinterpret_cast<const char*>(qh + ((j + kAhead) * nb + c0) * T::kQhBytes), _MM_HINT_T0);
    }
    for (int64_t i = 0; i < cn; ++i) {
      const int64_t b = c0 + i;
      if (b % kLineBlocks == 0) {
#pragma GCC unroll 4
        for (int j = 0; j < NR; ++j)
          _mm_prefetch(reinterpret_cast<const char*>(qs + ((j + kAhead) * nb + b) * T::kQsBytes), _MM_HINT_T0);
      }
      __m512 xlo[MR], xhi[MR];
#pragma GCC unroll 4
      for (int r = 0; r < MR; ++r) {
        xlo[r] = _mm512_loadu_ps(x + r * K + b * kBlock);
        xhi[r] = _mm512_loadu_ps(x + r * K + b * kBlock + 16);
      }
#pragma GCC unroll 4
      for (int j = 0; j < NR; ++j) {
        __m128i lo, hi;
        T::bytes(qs + (j * nb + b) * T::kQsBytes, qh + (j * nb + b) * T::kQhBytes, &lo, &hi);
        const __m512 q0 = widen16_512<T::kSigned>(lo), q1 = widen16_512<T::kSigned>(hi);
        const __m512 dj = _mm512_set1_ps(db[j][i]);
#pragma GCC unroll 4
        for (int r = 0; r < MR; ++r)
          acc[r][j] = _mm512_fmadd_ps(dj, _mm512_fmadd_ps(q1, xhi[r], _mm512_mul_ps(q0, xlo[r])), acc[r][j]);
      }
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NR; ++j) y[r * N + j] = _mm512_reduce_add_ps(acc[r][j]) + 0.0f;
}

// The weight rows [n0, n1) against a tile of MR rows of x, as q4_1_rows_512.
template <typename T, int MR>
JAXLLM_AVX512 void nomin_rows_512(const float* x, int64_t K, const uint16_t* d, const uint8_t* qs,
                                  const uint8_t* qh, float* y, int64_t N, int64_t n0, int64_t n1) {
  constexpr int NR = kRowsPerPass<MR>;
  const int64_t nb = K / kBlock;
  const int64_t first = std::min(n1, n0 + kAhead) - n0;
  jaxllm_gguf::prefetch(qs + n0 * nb * T::kQsBytes, first * nb * T::kQsBytes);
  jaxllm_gguf::prefetch(d + n0 * nb, first * nb * 2);
  if (T::kQhBytes) jaxllm_gguf::prefetch(qh + n0 * nb * T::kQhBytes, first * nb * T::kQhBytes);
  int64_t n = n0;
  for (; n + NR <= n1; n += NR)
    nomin_tile_512<T, MR, NR>(x, K, d + n * nb, qs + n * nb * T::kQsBytes, qh + n * nb * T::kQhBytes, y + n, N);
  for (; n < n1; ++n)
    nomin_tile_512<T, MR, 1>(x, K, d + n * nb, qs + n * nb * T::kQsBytes, qh + n * nb * T::kQhBytes, y + n, N);
}

// y = x . W^T for Q8_0, Q4_0 and Q5_0 weights on the AVX-512 path (as linear_q4_1_walk).
template <typename T>
JAXLLM_AVX512 void linear_nomin_512(ffi::ThreadPool& pool, const float* x, const uint16_t* d, const uint8_t* qs,
                                    const uint8_t* qh, float* y, int64_t M, int64_t K, int64_t N) {
  split_rows(pool, M, N, [=](int64_t n0, int64_t n1) {
    const int64_t tiles = (M + jaxllm_gguf::kMaxRows - 1) / jaxllm_gguf::kMaxRows;
    int64_t r0 = 0;
    for (int64_t t = 0; t < tiles; ++t) {
      const int rows = static_cast<int>(M / tiles + (t < M % tiles));
      const float* xt = x + r0 * K;
      float* yt = y + r0 * N;
      switch (rows) {
        case 1: nomin_rows_512<T, 1>(xt, K, d, qs, qh, yt, N, n0, n1); break;
        case 2: nomin_rows_512<T, 2>(xt, K, d, qs, qh, yt, N, n0, n1); break;
        case 3: nomin_rows_512<T, 3>(xt, K, d, qs, qh, yt, N, n0, n1); break;
        default: nomin_rows_512<T, 4>(xt, K, d, qs, qh, yt, N, n0, n1); break;
      }
      r0 += rows;
    }
  });
}

// Per-32-weight sums of x: [M, K / 32], for the types with a min (row r's at r * K / 32).
std::vector<float> block_sums(const float* x, int64_t M, int64_t K) {
  const int64_t nb = K / kBlock;
  std::vector<float> sums(M * nb);
  for (int64_t r = 0; r < M; ++r)
    for (int64_t b = 0; b < nb; ++b) {
      const float* xb = x + r * K + b * kBlock;
      __m256 s = _mm256_add_ps(_mm256_add_ps(_mm256_loadu_ps(xb), _mm256_loadu_ps(xb + 8)),
                               _mm256_add_ps(_mm256_loadu_ps(xb + 16), _mm256_loadu_ps(xb + 24)));
      sums[r * nb + b] = jaxllm_simd::hsum(s);
    }
  return sums;
}

// The AVX-512 walk's entry for linear_q4_1_walk.
struct Q4_1Rows512 {
  template <int MR>
  JAXLLM_AVX512 static void run(const float* x, int64_t K, const uint16_t* d, const uint16_t* m,
                                const uint8_t* qs, const float* sx, float* y, int64_t N, int64_t n0, int64_t n1) {
    q4_1_rows_512<MR>(x, K, d, m, qs, sx, y, N, n0, n1);
  }
};

// y = x . W^T for Q4_1 weights by a several-rows walk (Rows: Q4_1Rows512 on the AVX-512
// path, Q4_1Rows256 on the AVX2 one): the weight rows split over the pool as in linear(),
// each part walked tile of x by tile of x (tiles as rows_range makes them).
template <typename Rows>
void linear_q4_1_walk(ffi::ThreadPool& pool, const float* x, const uint16_t* d, const uint16_t* m,
                      const uint8_t* qs, const float* sx, float* y, int64_t M, int64_t K, int64_t N) {
  const int64_t nb = K / kBlock;
  split_rows(pool, M, N, [=](int64_t n0, int64_t n1) {
    const int64_t tiles = (M + jaxllm_gguf::kMaxRows - 1) / jaxllm_gguf::kMaxRows;
    int64_t r0 = 0;
    for (int64_t t = 0; t < tiles; ++t) {
      const int rows = static_cast<int>(M / tiles + (t < M % tiles));
      const float* xt = x + r0 * K;
      const float* st = sx + r0 * nb;
      float* yt = y + r0 * N;
      switch (rows) {
        case 1: Rows::template run<1>(xt, K, d, m, qs, st, yt, N, n0, n1); break;
        case 2: Rows::template run<2>(xt, K, d, m, qs, st, yt, N, n0, n1); break;
        case 3: Rows::template run<3>(xt, K, d, m, qs, st, yt, N, n0, n1); break;
        default: Rows::template run<4>(xt, K, d, m, qs, st, yt, N, n0, n1); break;
      }
      r0 += rows;
    }
  });
}

template <typename T>
void linear(ffi::ThreadPool& pool, const float* x, const uint16_t* d, const uint16_t* m, const uint8_t* qs,
            const uint8_t* qh, float* y, int64_t M, int64_t K, int64_t N) {
  const int64_t nb = K / kBlock;
  std::vector<float> sums;
  if (m != nullptr) sums = block_sums(x, M, K);
  const float* sx = m != nullptr ? sums.data() : nullptr;
  if constexpr (std::is_same_v<T, Q4_1>) {   // its walks at every M, on either path
    if (M >= kPanelMinRows) {   // a prefill: the weights widened once per call
      if (g_avx512) return linear_q4_1_panels<Q4_1Panels512>(pool, x, d, m, qs, sx, y, M, K, N);
      return linear_q4_1_panels<Q4_1Panels256>(pool, x, d, m, qs, sx, y, M, K, N);
    }
    if (g_avx512) return linear_q4_1_walk<Q4_1Rows512>(pool, x, d, m, qs, sx, y, M, K, N);
    return linear_q4_1_walk<Q4_1Rows256>(pool, x, d, m, qs, sx, y, M, K, N);
  } else {
    if constexpr (std::is_same_v<T, Q8_0> || std::is_same_v<T, Q4_0> || std::is_same_v<T, Q5_0>) {
      if (g_avx512) return linear_nomin_512<T>(pool, x, d, qs, qh, y, M, K, N);
    }
    const auto tile_fn = g_avx512 ? tile_512<T> : tile<T>;
    const auto prefetch_row = [=](int64_t a) {
      jaxllm_gguf::prefetch(qs + a * nb * T::kQsBytes, nb * T::kQsBytes);
      jaxllm_gguf::prefetch(d + a * nb, nb * 2);
      if (m) jaxllm_gguf::prefetch(m + a * nb, nb * 2);
      if (T::kQhBytes) jaxllm_gguf::prefetch(qh + a * nb * T::kQhBytes, nb * T::kQhBytes);
    };
    split_rows(pool, M, N, [=](int64_t n0, int64_t n1) {
      rows_range_prefetched(M, n0, n1, prefetch_row, [=](int rows, int64_t r0, int64_t n) {
        tile_fn(rows, x + r0 * K, K, d + n * nb, m ? m + n * nb : nullptr, qs + n * nb * T::kQsBytes,
                qh + n * nb * T::kQhBytes, sx ? sx + r0 * nb : nullptr, y + r0 * N + n, N);
      });
    });
  }
}

// ---- K-quants: 256-weight super-blocks whose sub-blocks have their own scale ----
//
// A super-block is handled as 8 rows of 32 weights (weights 32i .. 32i + 31), each widened
// in registers like a 32-weight block.  Its sub-block scales are float32 products of the
// f16 super-block scale and the small integer scales, as gguf rounds them:
//   Q4_K, Q5_K: row i has scale ds_i = d * sc_i and min dm_i = dmin * m_i; the weights are
//               ds_i * q - dm_i, so y += ds_i * sum(q * x) - dm_i * sum(x), the sums of x
//               per 32 weights computed once per call, the 8 min terms of a super-block
//               one vector FMA into the same 8-lane accumulator.
//   Q6_K:       16 sub-blocks of 16: row i's weights 0..15 scale by ds_2i, 16..31 by ds_2i+1
//               (q - 32 taken in the bytes, exact).
constexpr int64_t kSuper = 256;

// The 32 bytes of v as four float32 vectors (bytes 0..7, 8..15, 16..23, 24..31), signed or
// unsigned.
template <bool Signed>
inline void widen32(__m256i v, __m256 q[4]) {
  widen16<Signed>(_mm256_castsi256_si128(v), q);
  widen16<Signed>(_mm256_extracti128_si256(v, 1), q + 2);
}

inline __m256i load32(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

// Q4_K / Q5_K (Fifth): d, dmin [N, nb] f16 bits; scales [N, nb, 12]; qs [N, nb, 128];
// qh [N, nb, 32] (Q5_K).
template <bool Fifth>
struct Q45_K {
  static constexpr int64_t kQsBytes = kSuper / 2;
  static constexpr int64_t kQhBytes = Fifth ? kSuper / 8 : 0;
  static constexpr int64_t kScBytes = 12;
  static constexpr bool kHasMin = true;
  static constexpr bool kSplitScale = false;

  // The 12 bytes -> ds[8] (and dm[8]): bytes 0-3 hold scales 0-3 in their low 6 bits, bytes
  // 4-7 mins 0-3; scales and mins 4-7 are the nibbles of bytes 8-11 with their top 2 bits in
  // the spare top bits of bytes 0-7.
  static inline void scales(const uint8_t* sc, float d, float dmin, float ds[16], float dm[8]) {
    // as three little-endian words, every byte's part at once
    uint32_t w[3];
    __builtin_memcpy(w, sc, 12);
    const uint32_t s_lo = w[0] & 0x3F3F3F3F, m_lo = w[1] & 0x3F3F3F3F;
    const uint32_t s_hi = (w[2] & 0x0F0F0F0F) | ((w[0] >> 2) & 0x30303030);   // bits 6, 7 -> 4, 5
    const uint32_t m_hi = ((w[2] >> 4) & 0x0F0F0F0F) | ((w[1] >> 2) & 0x30303030);
    const __m128i s = _mm_setr_epi32(static_cast<int>(s_lo), static_cast<int>(s_hi), 0, 0);
    const __m128i m = _mm_setr_epi32(static_cast<int>(m_lo), static_cast<int>(m_hi), 0, 0);
    _mm256_store_ps(ds, _mm256_mul_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(s))));
    _mm256_store_ps(dm, _mm256_mul_ps(_mm256_set1_ps(dmin), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(m))));
  }

  // Row i: the low (even i) or high (odd i) nibbles of the 32-byte group i / 2 of qs, with
  // bit i of qh[j] as weight j's fifth bit (Q5_K).
  static constexpr bool kSigned = false;
  static inline __m256i bytes(const uint8_t* qs, const uint8_t* qh, int i) {
    const __m256i mask = _mm256_set1_epi8(0x0F);
    const __m128i shift = _mm_cvtsi32_si128(4 * (i & 1));
    __m256i v = _mm256_and_si256(_mm256_srl_epi16(load32(qs + 32 * (i >> 1)), shift), mask);
    if (Fifth) {
      const __m256i bit = _mm256_set1_epi8(static_cast<char>(1 << i));
      const __m256i h = _mm256_cmpeq_epi8(_mm256_and_si256(load32(qh), bit), bit);
      v = _mm256_or_si256(v, _mm256_and_si256(h, _mm256_set1_epi8(0x10)));
    }
    return v;
  }
  static inline void widen(const uint8_t* qs, const uint8_t* qh, int i, __m256 q[4]) {
    widen32<false>(bytes(qs, qh, i), q);
  }
};

// Q6_K: ql [N, nb, 128] (passed as qs); qh [N, nb, 64]; scales [N, nb, 16] int8; d [N, nb].
struct Q6_K {
  static constexpr int64_t kQsBytes = kSuper / 2;
  static constexpr int64_t kQhBytes = kSuper / 4;
  static constexpr int64_t kScBytes = 16;
  static constexpr bool kHasMin = false;
  static constexpr bool kSplitScale = true;

  static inline void scales(const uint8_t* sc, float d, float, float ds[16], float*) {
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(sc));   // 16 int8 scales
    const __m256 dv = _mm256_set1_ps(d);
    _mm256_store_ps(ds, _mm256_mul_ps(dv, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v))));
    _mm256_store_ps(ds + 8, _mm256_mul_ps(dv, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(v, 8)))));
  }

  // Row i = 4h + s of half h: q's low 4 bits are the low (s < 2) or high nibbles of
  // ql[64h + 32(s % 2) + j], its high 2 bits bits 2s, 2s + 1 of qh[32h + j].
  static constexpr bool kSigned = true;
  static inline __m256i bytes(const uint8_t* ql, const uint8_t* qh, int i) {
    const int h = i >> 2, s = i & 3;
    const __m256i lo = _mm256_and_si256(
        _mm256_srl_epi16(load32(ql + 64 * h + 32 * (s & 1)), _mm_cvtsi32_si128(4 * (s >> 1))),
        _mm256_set1_epi8(0x0F));
    const __m256i hi = _mm256_slli_epi16(
        _mm256_and_si256(_mm256_srl_epi16(load32(qh + 32 * h), _mm_cvtsi32_si128(2 * s)), _mm256_set1_epi8(3)), 4);
    return _mm256_sub_epi8(_mm256_or_si256(lo, hi), _mm256_set1_epi8(32));
  }
  static inline void widen(const uint8_t* ql, const uint8_t* qh, int i, __m256 q[4]) {
    widen32<true>(bytes(ql, qh, i), q);
  }
};

// One weight row's fields, at its first super-block.
struct KRow {
  const uint16_t* d;
  const uint16_t* dmin;   // Q4_K, Q5_K
  const uint8_t* scales;
  const uint8_t* qs;      // Q6_K: ql
  const uint8_t* qh;      // Q5_K, Q6_K
};

// y[r, n] for r < MR rows of x (K apart) and one weight row w; y rows N apart.
// sx: the rows' per-32-weight sums of x ([MR, K / 32]), used when T::kHasMin.
template <int MR, typename T>
inline void row_tile_k(const float* x, int64_t K, const KRow& w, const float* sx, float* y, int64_t N) {
  const int64_t nb = K / kSuper, nb32 = K / kBlock;
  __m256 acc[MR];
  for (int r = 0; r < MR; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    alignas(32) float ds[16], dm[8];
    T::scales(w.scales + b * T::kScBytes, f16(w.d[b]), T::kHasMin ? f16(w.dmin[b]) : 0.0f, ds, dm);
    const uint8_t* qs = w.qs + b * T::kQsBytes;
    const uint8_t* qh = w.qh + b * T::kQhBytes;
    for (int i = 0; i < 8; ++i) {
      __m256 q[4];
      T::widen(qs, qh, i, q);
      const float* xb = x + b * kSuper + i * kBlock;
      if constexpr (T::kSplitScale) {
        const __m256 s0 = _mm256_set1_ps(ds[2 * i]), s1 = _mm256_set1_ps(ds[2 * i + 1]);
#pragma GCC unroll 4
        for (int r = 0; r < MR; ++r) {
          const float* xr = xb + r * K;
          const __m256 a = _mm256_fmadd_ps(q[1], _mm256_loadu_ps(xr + 8), _mm256_mul_ps(q[0], _mm256_loadu_ps(xr)));
          const __m256 c =
              _mm256_fmadd_ps(q[3], _mm256_loadu_ps(xr + 24), _mm256_mul_ps(q[2], _mm256_loadu_ps(xr + 16)));
          acc[r] = _mm256_fmadd_ps(s1, c, _mm256_fmadd_ps(s0, a, acc[r]));
        }
      } else {
        const __m256 s0 = _mm256_set1_ps(ds[i]);
#pragma GCC unroll 4
        for (int r = 0; r < MR; ++r) {
          const float* xr = xb + r * K;
          __m256 a = _mm256_mul_ps(q[0], _mm256_loadu_ps(xr));
          a = _mm256_fmadd_ps(q[1], _mm256_loadu_ps(xr + 8), a);
          a = _mm256_fmadd_ps(q[2], _mm256_loadu_ps(xr + 16), a);
          a = _mm256_fmadd_ps(q[3], _mm256_loadu_ps(xr + 24), a);
          acc[r] = _mm256_fmadd_ps(s0, a, acc[r]);
        }
      }
    }
    if constexpr (T::kHasMin) {
      // lane i: - dm_i * sum of x over row i (the 8 rows' sums are 8 consecutive floats)
      const __m256 dmv = _mm256_load_ps(dm);
#pragma GCC unroll 4
      for (int r = 0; r < MR; ++r) acc[r] = _mm256_fnmadd_ps(dmv, _mm256_loadu_ps(sx + r * nb32 + b * 8), acc[r]);
    }
  }
  for (int r = 0; r < MR; ++r) y[r * N] = jaxllm_simd::hsum(acc[r]);
}

// The AVX-512 variant: a row's 32 weights as two 16-lane vectors (Q6_K: one per sub-block
// scale); the Q4_K / Q5_K min terms stay in an 8-lane accumulator of their own.
template <int MR, typename T>
JAXLLM_AVX512 void row_tile_k_512(const float* x, int64_t K, const KRow& w, const float* sx, float* y, int64_t N) {
  const int64_t nb = K / kSuper, nb32 = K / kBlock;
  __m512 acc[MR];
  __m256 accm[MR];
  for (int r = 0; r < MR; ++r) {
    acc[r] = _mm512_setzero_ps();
    accm[r] = _mm256_setzero_ps();
  }
  for (int64_t b = 0; b < nb; ++b) {
    alignas(32) float ds[16], dm[8];
    T::scales(w.scales + b * T::kScBytes, f16(w.d[b]), T::kHasMin ? f16(w.dmin[b]) : 0.0f, ds, dm);
    const uint8_t* qs = w.qs + b * T::kQsBytes;
    const uint8_t* qh = w.qh + b * T::kQhBytes;
    for (int i = 0; i < 8; ++i) {
      const __m256i v = T::bytes(qs, qh, i);
      const __m512 q0 = widen16_512<T::kSigned>(_mm256_castsi256_si128(v));
      const __m512 q1 = widen16_512<T::kSigned>(_mm256_extracti128_si256(v, 1));
      const float* xb = x + b * kSuper + i * kBlock;
      if constexpr (T::kSplitScale) {
        const __m512 s0 = _mm512_set1_ps(ds[2 * i]), s1 = _mm512_set1_ps(ds[2 * i + 1]);
#pragma GCC unroll 4
        for (int r = 0; r < MR; ++r) {
          const float* xr = xb + r * K;
          acc[r] = _mm512_fmadd_ps(s0, _mm512_mul_ps(q0, _mm512_loadu_ps(xr)), acc[r]);
          acc[r] = _mm512_fmadd_ps(s1, _mm512_mul_ps(q1, _mm512_loadu_ps(xr + 16)), acc[r]);
        }
      } else {
        const __m512 s0 = _mm512_set1_ps(ds[i]);
#pragma GCC unroll 4
        for (int r = 0; r < MR; ++r) {
          const float* xr = xb + r * K;
          const __m512 a = _mm512_fmadd_ps(q1, _mm512_loadu_ps(xr + 16), _mm512_mul_ps(q0, _mm512_loadu_ps(xr)));
          acc[r] = _mm512_fmadd_ps(s0, a, acc[r]);
        }
      }
    }
    if constexpr (T::kHasMin) {
      const __m256 dmv = _mm256_load_ps(dm);
#pragma GCC unroll 4
      for (int r = 0; r < MR; ++r) accm[r] = _mm256_fnmadd_ps(dmv, _mm256_loadu_ps(sx + r * nb32 + b * 8), accm[r]);
    }
  }
  for (int r = 0; r < MR; ++r) y[r * N] = _mm512_reduce_add_ps(acc[r]) + jaxllm_simd::hsum(accm[r]);
}

template <typename T>
JAXLLM_AVX512 void tile_k_512(int rows, const float* x, int64_t K, const KRow& w, const float* sx, float* y,
                              int64_t N) {
  switch (rows) {
    case 1: row_tile_k_512<1, T>(x, K, w, sx, y, N); break;
    case 2: row_tile_k_512<2, T>(x, K, w, sx, y, N); break;
    case 3: row_tile_k_512<3, T>(x, K, w, sx, y, N); break;
    default: row_tile_k_512<4, T>(x, K, w, sx, y, N); break;
  }
}

template <typename T>
void tile_k(int rows, const float* x, int64_t K, const KRow& w, const float* sx, float* y, int64_t N) {
  switch (rows) {
    case 1: row_tile_k<1, T>(x, K, w, sx, y, N); break;
    case 2: row_tile_k<2, T>(x, K, w, sx, y, N); break;
    case 3: row_tile_k<3, T>(x, K, w, sx, y, N); break;
    default: row_tile_k<4, T>(x, K, w, sx, y, N); break;
  }
}

template <typename T>
void linear_k(ffi::ThreadPool& pool, const float* x, const KRow& w0, float* y, int64_t M, int64_t K, int64_t N) {
  const int64_t nb = K / kSuper;
  std::vector<float> sums;
  if (T::kHasMin) sums = block_sums(x, M, K);
  const float* sx = sums.data();
  const int64_t nb32 = K / kBlock;
  const auto tile_fn = g_avx512 ? tile_k_512<T> : tile_k<T>;
  const auto prefetch_row = [=](int64_t a) {
    jaxllm_gguf::prefetch(w0.qs + a * nb * T::kQsBytes, nb * T::kQsBytes);
    jaxllm_gguf::prefetch(w0.scales + a * nb * T::kScBytes, nb * T::kScBytes);
    jaxllm_gguf::prefetch(w0.d + a * nb, nb * 2);
    if (w0.dmin) jaxllm_gguf::prefetch(w0.dmin + a * nb, nb * 2);
    if (w0.qh) jaxllm_gguf::prefetch(w0.qh + a * nb * T::kQhBytes, nb * T::kQhBytes);
  };
  split_rows(pool, M, N, [=](int64_t n0, int64_t n1) {
    rows_range_prefetched(M, n0, n1, prefetch_row, [=](int rows, int64_t r0, int64_t n) {
      const KRow w{w0.d + n * nb, w0.dmin ? w0.dmin + n * nb : nullptr, w0.scales + n * nb * T::kScBytes,
                   w0.qs + n * nb * T::kQsBytes, w0.qh ? w0.qh + n * nb * T::kQhBytes : nullptr};
      tile_fn(rows, x + r0 * K, K, w, T::kHasMin ? sx + r0 * nb32 : nullptr, y + r0 * N + n, N);
    });
  });
}

// Checks x[M, K] and a K-quant field f[N, K / 256, bytes] (bytes = 0: f is [N, K / 256]).
ffi::Error check_k(const char* name, ffi::Span<const int64_t> xd, int64_t N, const char* field,
                   ffi::Span<const int64_t> fd, int64_t bytes) {
  const int64_t nb = xd.size() == 2 ? xd[1] / kSuper : -1;
  const bool ok = xd.size() == 2 && xd[1] % kSuper == 0 && xd[1] > 0 &&
                  (bytes == 0 ? fd.size() == 2 && fd[0] == N && fd[1] == nb
                              : fd.size() == 3 && fd[0] == N && fd[1] == nb && fd[2] == bytes);
  if (!ok)
    return ffi::Error::InvalidArgument(std::string(name) + ": expected x[M, K] with K a multiple of 256 and " +
                                       field + "[N, K/256" + (bytes ? ", " + std::to_string(bytes) : "") + "]");
  return ffi::Error::Success();
}

template <bool Fifth>
ffi::Error LinearQ45_K(const char* name, ffi::ThreadPool& pool, ffi::Buffer<ffi::F32>& x, ffi::Buffer<ffi::U16>& d,
                       ffi::Buffer<ffi::U16>& dmin, ffi::Buffer<ffi::U8>& scales, const ffi::Buffer<ffi::U8>* qh,
                       ffi::Buffer<ffi::U8>& qs, ffi::ResultBuffer<ffi::F32>& y) {
  using T = Q45_K<Fifth>;
  auto xd = x.dimensions();
  const int64_t N = d.dimensions().size() == 2 ? d.dimensions()[0] : -1;
  for (auto e : {check_k(name, xd, N, "d", d.dimensions(), 0), check_k(name, xd, N, "dmin", dmin.dimensions(), 0),
                 check_k(name, xd, N, "scales", scales.dimensions(), T::kScBytes),
                 check_k(name, xd, N, "qs", qs.dimensions(), T::kQsBytes),
                 qh ? check_k(name, xd, N, "qh", qh->dimensions(), T::kQhBytes) : ffi::Error::Success()})
    if (e.failure()) return e;
  const KRow w{d.typed_data(), dmin.typed_data(), scales.typed_data(), qs.typed_data(),
               qh ? qh->typed_data() : nullptr};
  linear_k<T>(pool, x.typed_data(), w, y->typed_data(), xd[0], xd[1], N);
  return ffi::Error::Success();
}

ffi::Error LinearQ4_K(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U16> d,
                      ffi::Buffer<ffi::U16> dmin, ffi::Buffer<ffi::U8> scales, ffi::Buffer<ffi::U8> qs,
                      ffi::ResultBuffer<ffi::F32> y) {
  return LinearQ45_K<false>("jaxllm_linear_q4_k", pool, x, d, dmin, scales, nullptr, qs, y);
}

ffi::Error LinearQ5_K(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U16> d,
                      ffi::Buffer<ffi::U16> dmin, ffi::Buffer<ffi::U8> scales, ffi::Buffer<ffi::U8> qh,
                      ffi::Buffer<ffi::U8> qs, ffi::ResultBuffer<ffi::F32> y) {
  return LinearQ45_K<true>("jaxllm_linear_q5_k", pool, x, d, dmin, scales, &qh, qs, y);
}

ffi::Error LinearQ6_K(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> ql,
                      ffi::Buffer<ffi::U8> qh, ffi::Buffer<ffi::S8> scales, ffi::Buffer<ffi::U16> d,
                      ffi::ResultBuffer<ffi::F32> y) {
  const char* name = "jaxllm_linear_q6_k";
  auto xd = x.dimensions();
  const int64_t N = d.dimensions().size() == 2 ? d.dimensions()[0] : -1;
  for (auto e : {check_k(name, xd, N, "d", d.dimensions(), 0), check_k(name, xd, N, "ql", ql.dimensions(), Q6_K::kQsBytes),
                 check_k(name, xd, N, "qh", qh.dimensions(), Q6_K::kQhBytes),
                 check_k(name, xd, N, "scales", scales.dimensions(), Q6_K::kScBytes)})
    if (e.failure()) return e;
  const KRow w{d.typed_data(), nullptr, reinterpret_cast<const uint8_t*>(scales.typed_data()), ql.typed_data(),
               qh.typed_data()};
  linear_k<Q6_K>(pool, x.typed_data(), w, y->typed_data(), xd[0], xd[1], N);
  return ffi::Error::Success();
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

// ---- 16-bit floats: F16 and BF16 GGUF matrices, bits [N, K] row-major ----
//
// Eight weights per load widened to float32 (F16C's vcvtph2ps; bf16: the bits shifted into
// a float32's top half), multiplied with FMAs; K % 8 tail weights one at a time.

template <bool BF16>
inline __m256 load8_16(const uint16_t* w) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w));
  if (BF16) return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  return _mm256_cvtph_ps(h);
}

template <bool BF16>
inline float scalar_16(uint16_t w) {
  if (!BF16) return f16(w);
  const uint32_t bits = static_cast<uint32_t>(w) << 16;
  float f;
  __builtin_memcpy(&f, &bits, 4);
  return f;
}

template <int MR, bool BF16>
inline void row_tile_16(const float* x, int64_t K, const uint16_t* w, float* y, int64_t N) {
  __m256 acc[MR];
  for (int r = 0; r < MR; ++r) acc[r] = _mm256_setzero_ps();
  const int64_t K8 = K - K % 8;
  for (int64_t k = 0; k < K8; k += 8) {
    const __m256 wv = load8_16<BF16>(w + k);
#pragma GCC unroll 4
    for (int r = 0; r < MR; ++r) acc[r] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + r * K + k), acc[r]);
  }
  for (int r = 0; r < MR; ++r) {
    float tail = 0.0f;
    for (int64_t k = K8; k < K; ++k) tail += scalar_16<BF16>(w[k]) * x[r * K + k];
    y[r * N] = jaxllm_simd::hsum(acc[r]) + tail;
  }
}

template <bool BF16>
void linear_16(ffi::ThreadPool& pool, const float* x, const uint16_t* w, float* y, int64_t M, int64_t K, int64_t N) {
  const auto prefetch_row = [=](int64_t a) { jaxllm_gguf::prefetch(w + a * K, K * 2); };
  split_rows(pool, M, N, [=](int64_t n0, int64_t n1) {
    rows_range_prefetched(M, n0, n1, prefetch_row, [=](int rows, int64_t r0, int64_t n) {
      const float* xt = x + r0 * K;
      float* yt = y + r0 * N + n;
      switch (rows) {
        case 1: row_tile_16<1, BF16>(xt, K, w + n * K, yt, N); break;
        case 2: row_tile_16<2, BF16>(xt, K, w + n * K, yt, N); break;
        case 3: row_tile_16<3, BF16>(xt, K, w + n * K, yt, N); break;
        default: row_tile_16<4, BF16>(xt, K, w + n * K, yt, N); break;
      }
    });
  });
}

template <bool BF16>
ffi::Error Linear16(const char* name, ffi::ThreadPool& pool, ffi::Buffer<ffi::F32>& x, ffi::Buffer<ffi::U16>& w,
                    ffi::ResultBuffer<ffi::F32>& y) {
  auto xd = x.dimensions();
  auto wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2 || wd[1] != xd[1])
    return ffi::Error::InvalidArgument(std::string(name) + ": expected x[M, K] and bits[N, K]");
  linear_16<BF16>(pool, x.typed_data(), w.typed_data(), y->typed_data(), xd[0], xd[1], wd[0]);
  return ffi::Error::Success();
}

ffi::Error LinearF16(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U16> w,
                     ffi::ResultBuffer<ffi::F32> y) {
  return Linear16<false>("jaxllm_linear_gguf_f16", pool, x, w, y);
}

ffi::Error LinearBF16(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U16> w,
                      ffi::ResultBuffer<ffi::F32> y) {
  return Linear16<true>("jaxllm_linear_gguf_bf16", pool, x, w, y);
}

}  // namespace

// Whether the AVX-512 tiles are used (the tests run both paths): on = 0 forces the 8-lane
// path, on = 1 the AVX-512 one where the CPU has it.  Returns whether AVX-512 is now used.
extern "C" int jaxllm_quant_linear_set_avx512(int on) {
  g_avx512 = on && kHasAvx512;
  return g_avx512;
}

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

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxllmLinearQ4_K, LinearQ4_K,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // x
                                  .Arg<ffi::Buffer<ffi::U16>>()   // d
                                  .Arg<ffi::Buffer<ffi::U16>>()   // dmin
                                  .Arg<ffi::Buffer<ffi::U8>>()    // scales
                                  .Arg<ffi::Buffer<ffi::U8>>()    // qs
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxllmLinearQ5_K, LinearQ5_K,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // x
                                  .Arg<ffi::Buffer<ffi::U16>>()   // d
                                  .Arg<ffi::Buffer<ffi::U16>>()   // dmin
                                  .Arg<ffi::Buffer<ffi::U8>>()    // scales
                                  .Arg<ffi::Buffer<ffi::U8>>()    // qh
                                  .Arg<ffi::Buffer<ffi::U8>>()    // qs
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxllmLinearQ6_K, LinearQ6_K,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // x
                                  .Arg<ffi::Buffer<ffi::U8>>()    // ql
                                  .Arg<ffi::Buffer<ffi::U8>>()    // qh
                                  .Arg<ffi::Buffer<ffi::S8>>()    // scales
                                  .Arg<ffi::Buffer<ffi::U16>>()   // d
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxllmLinearGgufF16, LinearF16,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // x
                                  .Arg<ffi::Buffer<ffi::U16>>()   // bits
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxllmLinearGgufBF16, LinearBF16,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // x
                                  .Arg<ffi::Buffer<ffi::U16>>()   // bits
                                  .Ret<ffi::Buffer<ffi::F32>>());
