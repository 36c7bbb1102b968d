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
// pool as in quant_linear.cc (gguf_simd.h's split_rows).  Three tile paths compute the same
// integer sums: AVX2 (maddubs), AVX-512 VNNI (two blocks per register), and, for weights laid
// out in interleaved groups of 16 rows at load, the jaxllm_dot16_* targets (see "AVX-512 VNNI
// over 16 interleaved weight rows" below), which run on AMX for calls of 32 rows or more where
// the CPU has it (same bits).  jaxllm_dot_i16_q4_1 is Q4_1 by activations rounded to int16
// instead (float32's accuracy, fewer vector operations than float32 FMAs; see "Q4_1 by int16
// activations" below), jaxllm_dot16_i16_q4_1 and jaxllm_dot16_i16_q8_0 the same in
// interleaved groups of 16 rows.  Called from jaxllm/quant/native_matmul.py via XLA's FFI.
#include <cpuid.h>
#include <immintrin.h>
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include <algorithm>
#include <cmath>
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
using jaxllm_gguf::rows_range_prefetched;
using jaxllm_gguf::split_rows;

namespace {

constexpr int64_t kBlock = 32;

// One 32-value block of x rounded to integers at the scale *d = max|x| / levels (to nearest,
// ties to even) as four vectors of 8 int32 (values 0..7, ..., 24..31), and *s, the float sum
// of the block (the min term's, exact: not of the rounded values).
inline void round_block(const float* xb, float levels, __m256i q[4], float* d, float* s) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 v[4];
  __m256 amax = _mm256_setzero_ps();
  for (int j = 0; j < 4; ++j) {
    v[j] = _mm256_loadu_ps(xb + 8 * j);
    amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[j]));
  }
  *d = jaxllm_simd::hmax(amax) / levels;
  const __m256 inv = _mm256_set1_ps(*d > 0.0f ? 1.0f / *d : 0.0f);
  for (int j = 0; j < 4; ++j)
    q[j] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v[j], inv), _MM_FROUND_TO_NEAREST_INT |
                                                                          _MM_FROUND_NO_EXC));
  *s = jaxllm_simd::hsum(_mm256_add_ps(_mm256_add_ps(v[0], v[1]), _mm256_add_ps(v[2], v[3])));
}

// x [M, K] -> qx [M, K] int8 and, per block, dx [M, nb] (the scale) and sx [M, nb] (sum of x).
void quantize_rows(const float* x, int64_t M, int64_t K, int8_t* qx, float* dx, float* sx) {
  const int64_t nb = K / kBlock;
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int64_t i = 0; i < M * nb; ++i) {
    __m256i q[4];
    round_block(x + i * kBlock, 127.0f, q, dx + i, sx + i);
    // int32 x 32 -> int8 x 32; the packs interleave 128-bit lanes, the permute restores order
    const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(qx + i * kBlock), _mm256_permutevar8x32_epi32(p, order));
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

// Low nibbles in bytes 0..15, high ones in 16..31 (jaxllm_gguf::nibbles' halves), one mask for both.
inline __m256i nibble_bytes(const uint8_t* qs) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(v, 4), v), _mm256_set1_epi8(0x0F));
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

// ---- Q4_1 at one row of x, AVX2: four weight rows per pass ----
//
// A batch-1 decode step's calls (M = 1) with the built-in model's Q4_1 weights, where the CPU
// lacks VNNI.  row_tile takes one weight row at a time and converts each block's d and m by
// a scalar f16 -> f32 and d * dx by a scalar product: 1.7-1.9 ns a block on a Zen 3 core.
// Here four weight rows share each block of x (its int8 lanes loaded once), and a chunk of 8
// blocks' d * dx and m is converted by one vcvtph2ps and one multiply per weight row:
// 1.2-1.4 ns (docs/BENCHMARKS.md, "int8 activations at batch 1 on AVX2").  For each weight
// row the operations and their order are row_tile<1>'s (the same products d * dx, the same
// FMA chain over blocks, the same min sum and final add), so its bits are row_tile's at any
// M: a token's logits do not depend on its batch.  Q4_1 only: the same walk over the Q8_0 LM
// head (49152 rows, read at the memory's rate by row_tile) took 1.7-2.0 against 1.3 ns a block.
constexpr int64_t kChunk = 8;   // blocks whose d * dx and m are converted at once

template <int NR>
void q4_1_pass(const Activations& a, int64_t K, const uint16_t* d, const uint16_t* m, const uint8_t* qs,
               float* y) {
  const int64_t nb = K / kBlock;
  __m256 acc[NR];   // per weight row, as row_tile's
  for (__m256& v : acc) v = _mm256_setzero_ps();
  float macc[NR] = {};
  alignas(32) float sc[NR][kChunk], mf[NR][kChunk];   // this chunk's d * dx and m, per weight row
  for (int64_t c0 = 0; c0 < nb; c0 += kChunk) {
    const int64_t cn = std::min<int64_t>(kChunk, nb - c0);
#pragma GCC unroll 4
    for (int j = 0; j < NR; ++j) {
      const uint16_t* dj = d + j * nb + c0;
      const uint16_t* mj = m + j * nb + c0;
      if (cn == kChunk) {
        const __m256 dv = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(dj)));
        _mm256_store_ps(sc[j], _mm256_mul_ps(dv, _mm256_loadu_ps(a.d + c0)));
        _mm256_store_ps(mf[j], _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(mj))));
      } else {
        for (int64_t i = 0; i < cn; ++i) {
          sc[j][i] = f16(dj[i]) * a.d[c0 + i];
          mf[j][i] = f16(mj[i]);
        }
      }
    }
    for (int64_t i = 0; i < cn; ++i) {
      const int64_t b = c0 + i;
      const __m256i qa = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.q + b * kBlock));
#pragma GCC unroll 4
      for (int j = 0; j < NR; ++j) {
        const __m256i w = nibble_bytes(qs + (j * nb + b) * Q4_1::kQsBytes);
        acc[j] = _mm256_fmadd_ps(_mm256_set1_ps(sc[j][i]), dot32<false>(w, qa), acc[j]);
      }
#pragma GCC unroll 4
      for (int j = 0; j < NR; ++j) macc[j] += mf[j][i] * a.s[b];
    }
  }
  for (int j = 0; j < NR; ++j) y[j] = jaxllm_simd::hsum(acc[j]) + macc[j];
}

// Weight rows [n0, n1) against the one row of x, four at a time (the rest one by one), the
// rows kPrefetchRows ahead requested as each pass starts.
template <typename PrefetchRow>
void q4_1_rows(const Activations& a, int64_t K, const uint16_t* d, const uint16_t* m, const uint8_t* qs, float* y,
               int64_t n0, int64_t n1, const PrefetchRow& prefetch_row) {
  constexpr int NR = 4;
  const int64_t nb = K / kBlock;
  constexpr int64_t ahead = jaxllm_gguf::kPrefetchRows;
  for (int64_t n = n0; n < std::min(n1, n0 + ahead); ++n) prefetch_row(n);
  int64_t n = n0;
  for (; n + NR <= n1; n += NR) {
    for (int64_t p = n + ahead; p < std::min(n1, n + ahead + NR); ++p) prefetch_row(p);
    q4_1_pass<NR>(a, K, d + n * nb, m + n * nb, qs + n * nb * Q4_1::kQsBytes, y + n);
  }
  for (; n < n1; ++n) q4_1_pass<1>(a, K, d + n * nb, m + n * nb, qs + n * nb * Q4_1::kQsBytes, y + n);
}

// ---- Q4_1 by int16 activations (--cpu-matmul native-int16), AVX2 ----
//
// quant_linear.cc's float32 walk widens each block's 32 nibbles to four float32 vectors
// (4 converts, 4 FMAs): on a Zen 3 core it is bound by those vector operations, 2.0-2.5 ns
// a block, and a batch-1 decode step spends most of its time there.  Here x's 32-value
// blocks are rounded to int16 once per call (scale dx = max|x| / 32767, round to nearest
// even: at most dx / 2 per value, 1/258 of int8's rounding), and a block meets them in
// integer arithmetic: one vpshufb spreads the 16 quant bytes over 16-bit lanes, an and and
// a shift split the nibbles (weights 0..15, 16..31), and two vpmaddwd sum the products into
// 8 int32 lanes, each at most 4 * 15 * 32767 < 2^24, so exact in int32 and in the one
// float32 convert.  Per block and (row of x, weight row):
//   per chunk c of 8 blocks:  acc = fma(m[c], sx[c], acc) lane by lane (lanes past nb: +0 * +0)
//                             sc  = d[c] * dx[c] lane by lane
//   then per block b of it:   acc = fma(sc_b, float(int32 lanes of sum(q * qx)), acc)
//   y = hsum(acc)
// sx is the float sum of the block of x, so the min term is exact.  The operations and their
// order per (row of x, weight row) do not depend on M or on the rows sharing a pass, so a
// token's logits are the same bits in every step shape.  Below 32 rows of x every call takes
// this walk (tiles of up to 4 rows of x), from 32 the panels below.
struct Activations16 {
  const int16_t* q;   // [M, K]
  const float* d;     // [M, nb] the blocks' scales dx
  const float* s;     // [M, nb] the blocks' float sums of x
};

// x [M, K] -> qx [M, K] int16 and, per block, dx [M, nb] (the scale) and sx [M, nb] (sum of x).
// kPaired: each 4 values of qx stored in the order (0, 2, 1, 3) (jaxllm_dot16_i16_q4_1's pairs).
template <bool kPaired = false>
void quantize_rows16(const float* x, int64_t M, int64_t K, int16_t* qx, float* dx, float* sx) {
  const int64_t nb = K / kBlock;
  for (int64_t i = 0; i < M * nb; ++i) {
    __m256i q[4];
    round_block(x + i * kBlock, 32767.0f, q, dx + i, sx + i);
    // int32 x 16 -> int16 x 16 twice; the pack interleaves 128-bit lanes, the permute restores order
    int16_t* out = qx + i * kBlock;
    for (int h = 0; h < 2; ++h) {
      __m256i v = _mm256_permute4x64_epi64(_mm256_packs_epi32(q[2 * h], q[2 * h + 1]), 0xD8);
      if (kPaired)   // words (0, 2, 1, 3) within each 64 bits: two in-lane shuffles
        v = _mm256_shufflehi_epi16(_mm256_shufflelo_epi16(v, _MM_SHUFFLE(3, 1, 2, 0)), _MM_SHUFFLE(3, 1, 2, 0));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 16 * h), v);
    }
  }
}

constexpr int64_t kAhead16 = 8;   // weight rows ahead whose fields are prefetched

// The tile below reads its NR weight rows through one of two readers: a chunk's d and m as
// 8 float32 lanes (+0 past nb) and a block's weights as 16-bit lanes, lo = weights 0..15 and
// hi = 16..31.  PackedRows widens the GGUF fields in registers (a decode); PanelRows reads
// them widened once per call (a prefill, below).  Both give the same values.
struct PackedRows {
  const uint16_t* d;   // [rows, nb] at the tile's first row
  const uint16_t* m;
  const uint8_t* qs;   // [rows, nb, 16]
  int64_t nb;
  template <int NR>
  void prefetch_chunk(int64_t c0) const { jaxllm_gguf::prefetch_q4_1_scales<NR>(d, m, nb, c0, kAhead16); }
  template <int NR>
  void prefetch_block(int64_t b) const { jaxllm_gguf::prefetch_q4_1_quants<NR>(qs, nb, b, kAhead16); }
  void scales(int j, int64_t c0, int64_t cn, __m256 lanes, __m256* dv, __m256* mv) const {
    *dv = jaxllm_gguf::f16x8(d + j * nb, nb, c0, cn, lanes);
    *mv = jaxllm_gguf::f16x8(m + j * nb, nb, c0, cn, lanes);
  }
  void block(int j, int64_t b, __m256i* lo, __m256i* hi) const {
    // byte k of the block to 16-bit lane k (the same 16 bytes in both 128-bit halves)
    const __m256i spread = _mm256_setr_epi8(0, -1, 1, -1, 2, -1, 3, -1, 4, -1, 5, -1, 6, -1, 7, -1,
                                            8, -1, 9, -1, 10, -1, 11, -1, 12, -1, 13, -1, 14, -1, 15, -1);
    const __m256i w = _mm256_shuffle_epi8(
        _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs + (j * nb + b) * 16))), spread);
    *lo = _mm256_and_si256(w, _mm256_set1_epi16(15));
    *hi = _mm256_srli_epi16(w, 4);
  }
};

struct PanelRows {
  const int16_t* qp;   // [rows, nb, 32]: per block lo, then hi
  const float* dp;     // [rows, nbp]
  const float* mp;
  int64_t nb, nbp;
  template <int NR>
  void prefetch_chunk(int64_t) const {}   // the panel is in L2
  template <int NR>
  void prefetch_block(int64_t) const {}
  void scales(int j, int64_t c0, int64_t, __m256, __m256* dv, __m256* mv) const {
    *dv = _mm256_loadu_ps(dp + j * nbp + c0);
    *mv = _mm256_loadu_ps(mp + j * nbp + c0);
  }
  void block(int j, int64_t b, __m256i* lo, __m256i* hi) const {
    const int16_t* qb = qp + (j * nb + b) * kBlock;
    *lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qb));
    *hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qb + 16));
  }
};

// MR rows of x (a.q etc. at their first) against NR weight rows (w at their first); y at
// [row 0, weight row 0], rows of x N apart.
template <int MR, int NR, typename Rows>
void q4_1_tile16(const Activations16& a, int64_t K, const Rows& w, float* y, int64_t N) {
  using jaxllm_gguf::kChunk8;
  const int64_t nb = K / kBlock;
  __m256 acc[MR][NR];
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NR; ++j) acc[r][j] = _mm256_setzero_ps();
  alignas(32) float sc[MR][NR][kChunk8];   // this chunk's d * dx
  for (int64_t c0 = 0; c0 < nb; c0 += kChunk8) {
    const int64_t cn = std::min<int64_t>(kChunk8, nb - c0);
    const __m256i lanes = jaxllm_gguf::chunk_lanes(cn);
#pragma GCC unroll 4
    for (int j = 0; j < NR; ++j) {
      __m256 dv, mv;
      w.scales(j, c0, cn, _mm256_castsi256_ps(lanes), &dv, &mv);
#pragma GCC unroll 4
      for (int r = 0; r < MR; ++r) {
        _mm256_store_ps(sc[r][j], _mm256_mul_ps(dv, _mm256_maskload_ps(a.d + r * nb + c0, lanes)));
        acc[r][j] = _mm256_fmadd_ps(mv, _mm256_maskload_ps(a.s + r * nb + c0, lanes), acc[r][j]);
      }
    }
    w.template prefetch_chunk<NR>(c0);
    for (int64_t i = 0; i < cn; ++i) {
      const int64_t b = c0 + i;
      w.template prefetch_block<NR>(b);
#pragma GCC unroll 4
      for (int j = 0; j < NR; ++j) {
        __m256i lo, hi;
        w.block(j, b, &lo, &hi);
#pragma GCC unroll 4
        for (int r = 0; r < MR; ++r) {
          const int16_t* xb = a.q + r * K + b * kBlock;
          const __m256i p = _mm256_add_epi32(
              _mm256_madd_epi16(lo, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb))),
              _mm256_madd_epi16(hi, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb + 16))));
          acc[r][j] = _mm256_fmadd_ps(_mm256_broadcast_ss(&sc[r][j][i]), _mm256_cvtepi32_ps(p), acc[r][j]);
        }
      }
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NR; ++j) y[r * N + j] = jaxllm_simd::hsum(acc[r][j]);
}

// Weight rows [n0, n1) against MR rows of x, NR at a time (the last < NR one by one): 2 * MR
// * NR accumulators and partials within the 16 ymm registers, as the float walk's.
template <int MR>
void q4_1_rows16(const Activations16& a, int64_t K, const uint16_t* d, const uint16_t* m, const uint8_t* qs,
                 float* y, int64_t N, int64_t n0, int64_t n1) {
  constexpr int NR = MR == 1 ? 4 : MR == 2 ? 2 : 1;
  const int64_t nb = K / kBlock;
  jaxllm_gguf::prefetch_q4_1_rows(d, m, qs, nb, n0, std::min(n1, n0 + kAhead16) - n0);
  int64_t n = n0;
  for (; n + NR <= n1; n += NR)
    q4_1_tile16<MR, NR>(a, K, PackedRows{d + n * nb, m + n * nb, qs + n * nb * 16, nb}, y + n, N);
  for (; n < n1; ++n) q4_1_tile16<MR, 1>(a, K, PackedRows{d + n * nb, m + n * nb, qs + n * nb * 16, nb}, y + n, N);
}

// ---- the same from 32 rows of x (a prefill): weight rows widened once per call ----
//
// The walk widens each block (load, vpshufb, and, shift) once per tile of up to 4 rows of x.
// From kPanelMinRows16 rows on, each part's weight rows are widened kPanelRows16 at a time into
// panels (PanelRows: qp [rows, nb, 32] int16, each block's lo and hi in turn; dp, mp [rows,
// nbp] float32, nbp = nb rounded up to 8, +0 past nb) and 4 x 2 tiles of (rows of x, weight
// rows) run on plain loads: 1.3 against the float32 panels' 1.9 ns per block and pair on a
// Zen 3 core.  The panels hold the walk's values and the tile is the walk's, so a row's bits
// are the same as in a decode step's call.
constexpr int64_t kPanelMinRows16 = 32;
constexpr int64_t kPanelRows16 = 64;   // weight rows widened at once (64 x K x 2 bytes: L2)
constexpr int kPanelMR16 = 4, kPanelNR16 = 2;   // 8 accumulators + 2 x 2 weight vectors in 16 ymm

// The panel's rows [0, pn) against MR rows of x, kPanelNR16 at a time (the last one alone).
template <int MR>
void q4_1_panel_rows16(const Activations16& a, int64_t K, const int16_t* qp, const float* dp, const float* mp,
                       int64_t nbp, float* y, int64_t N, int64_t pn) {
  const int64_t nb = K / kBlock;
  const auto rows = [&](int64_t k) { return PanelRows{qp + k * nb * kBlock, dp + k * nbp, mp + k * nbp, nb, nbp}; };
  int64_t j = 0;
  for (; j + kPanelNR16 <= pn; j += kPanelNR16) q4_1_tile16<MR, kPanelNR16>(a, K, rows(j), y + j, N);
  for (; j < pn; ++j) q4_1_tile16<MR, 1>(a, K, rows(j), y + j, N);
}

// Weight rows [n0, n0 + pn) widened into the panels (layout above), by PackedRows' reads.
void q4_1_widen_panel16(const uint16_t* d, const uint16_t* m, const uint8_t* qs, int64_t nb, int64_t nbp, int64_t n0,
                        int64_t pn, int16_t* qp, float* dp, float* mp) {
  using jaxllm_gguf::kChunk8;
  const PackedRows w{d + n0 * nb, m + n0 * nb, qs + n0 * nb * 16, nb};
  for (int j = 0; j < pn; ++j) {
    for (int64_t b = 0; b < nb; ++b) {
      __m256i lo, hi;
      w.block(j, b, &lo, &hi);
      int16_t* out = qp + (j * nb + b) * kBlock;
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), lo);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 16), hi);
    }
    for (int64_t c0 = 0; c0 < nbp; c0 += kChunk8) {
      const int64_t cn = std::min<int64_t>(kChunk8, nb - c0);   // >= 1: nbp < nb + kChunk8
      __m256 dv, mv;
      w.scales(j, c0, cn, _mm256_castsi256_ps(jaxllm_gguf::chunk_lanes(cn)), &dv, &mv);
      _mm256_storeu_ps(dp + j * nbp + c0, dv);
      _mm256_storeu_ps(mp + j * nbp + c0, mv);
    }
  }
}

// y = x . W^T for Q4_1 weights by int16 activations: x rounded once, then the weight rows
// split over the pool as in linear(), each part walking them (M < 32) or widening them into
// panels (M >= 32) for every tile of x.
void linear_q4_1_i16(ffi::ThreadPool& pool, const float* x, const uint16_t* d, const uint16_t* m,
                     const uint8_t* qs, float* y, int64_t M, int64_t K, int64_t N) {
  const int64_t nb = K / kBlock;
  jaxllm_simd::LineVector<int16_t> qx(M * K);
  std::vector<float> dx(M * nb), sx(M * nb);
  quantize_rows16(x, M, K, qx.data(), dx.data(), sx.data());
  const auto rows_of_x = [&](int64_t r0) {
    return Activations16{qx.data() + r0 * K, dx.data() + r0 * nb, sx.data() + r0 * nb};
  };
  if (M >= kPanelMinRows16) {
    const int64_t nbp = (nb + jaxllm_gguf::kChunk8 - 1) / jaxllm_gguf::kChunk8 * jaxllm_gguf::kChunk8;
    split_rows(pool, M, N, [&](int64_t n0, int64_t n1) {
      const int64_t rows = std::min<int64_t>(kPanelRows16, n1 - n0);
      jaxllm_simd::LineVector<int16_t> qp(rows * nb * kBlock);
      jaxllm_simd::LineVector<float> dp(rows * nbp), mp(rows * nbp);
      for (int64_t p0 = n0; p0 < n1; p0 += kPanelRows16) {
        const int64_t pn = std::min<int64_t>(kPanelRows16, n1 - p0);
        q4_1_widen_panel16(d, m, qs, nb, nbp, p0, pn, qp.data(), dp.data(), mp.data());
        for (int64_t r0 = 0; r0 < M; r0 += kPanelMR16) {
          const Activations16 a = rows_of_x(r0);
          float* yt = y + r0 * N + p0;
          switch (std::min<int64_t>(kPanelMR16, M - r0)) {
            case 1: q4_1_panel_rows16<1>(a, K, qp.data(), dp.data(), mp.data(), nbp, yt, N, pn); break;
            case 2: q4_1_panel_rows16<2>(a, K, qp.data(), dp.data(), mp.data(), nbp, yt, N, pn); break;
            case 3: q4_1_panel_rows16<3>(a, K, qp.data(), dp.data(), mp.data(), nbp, yt, N, pn); break;
            default: q4_1_panel_rows16<kPanelMR16>(a, K, qp.data(), dp.data(), mp.data(), nbp, yt, N, pn); break;
          }
        }
      }
    });
    return;
  }
  split_rows(pool, M, N, [&](int64_t n0, int64_t n1) {
    // tiles of x as even as possible (7 rows: 4 + 3), as jaxllm_gguf::rows_range
    const int64_t tiles = (M + jaxllm_gguf::kMaxRows - 1) / jaxllm_gguf::kMaxRows;
    int64_t r0 = 0;
    for (int64_t t = 0; t < tiles; ++t) {
      const int rows = static_cast<int>(M / tiles + (t < M % tiles));
      const Activations16 a = rows_of_x(r0);
      float* yt = y + r0 * N;
      switch (rows) {
        case 1: q4_1_rows16<1>(a, K, d, m, qs, yt, N, n0, n1); break;
        case 2: q4_1_rows16<2>(a, K, d, m, qs, yt, N, n0, n1); break;
        case 3: q4_1_rows16<3>(a, K, d, m, qs, yt, N, n0, n1); break;
        default: q4_1_rows16<4>(a, K, d, m, qs, yt, N, n0, n1); break;
      }
      r0 += rows;
    }
  });
}

// ---- AVX-512 VNNI: two blocks per 512-bit register, chosen at run time ----
//
// One vpdpbusd multiplies 64 unsigned weight bytes by 64 signed activation bytes and sums
// each 4 adjacent products into 16 int32 lanes: lanes 0-7 hold block b's partial sums,
// lanes 8-15 block b + 1's, so one float conversion and one FMA by the lanes' scales
// (d * dx of each block, dx expanded to 8 lanes per block at quantization) add two blocks
// to the accumulator.  The integer sums are the AVX2 path's exactly (signed weights lend
// their sign to the activations the same way); only the order of the float additions differs.
// Used when the CPU has AVX512F/BW/VNNI (jaxllm_quant_dot_set_avx512 selects the AVX2 tiles
// so that the tests run both paths on one machine).
#define JAXLLM_VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")))

bool detect_vnni() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vnni");
}
const bool kHasVnni = detect_vnni();
bool g_vnni = kHasVnni;

// Blocks b and b + 1's 64 weights as bytes in weight order, block b in bytes 0-31.
template <typename T>
JAXLLM_VNNI inline __m512i pair_bytes(const uint8_t* qs, const uint8_t* qh);

JAXLLM_VNNI inline __m512i nibble_pair(const uint8_t* qs) {
  // [qs_b | qs_b+1] (16 bytes each) -> [qs_b, qs_b, qs_b+1, qs_b+1], then the low nibbles in
  // the first copy of each and the high nibbles in the second: weights 0-15, 16-31 of each.
  const __m512i v = _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs)));
  const __m512i twice = _mm512_permutexvar_epi64(_mm512_setr_epi64(0, 1, 0, 1, 2, 3, 2, 3), v);
  const __m512i shift = _mm512_setr_epi64(0, 0, 0x0004000400040004LL, 0x0004000400040004LL, 0, 0,
                                          0x0004000400040004LL, 0x0004000400040004LL);
  return _mm512_and_si512(_mm512_srlv_epi16(twice, shift), _mm512_set1_epi8(0x0F));
}

// qh of blocks b and b + 1 (4 bytes each, contiguous) is a 64-bit mask of the bytes'
// fifth bits, in the same order as the bytes.
JAXLLM_VNNI inline __m512i add_fifth_bits(__m512i q, const uint8_t* qh) {
  uint64_t h;
  __builtin_memcpy(&h, qh, 8);
  return _mm512_mask_add_epi8(q, _cvtu64_mask64(h), q, _mm512_set1_epi8(0x10));
}

template <>
JAXLLM_VNNI inline __m512i pair_bytes<Q8_0>(const uint8_t* qs, const uint8_t*) {
  return _mm512_loadu_si512(qs);
}
template <>
JAXLLM_VNNI inline __m512i pair_bytes<Q4_0>(const uint8_t* qs, const uint8_t*) {
  return _mm512_sub_epi8(nibble_pair(qs), _mm512_set1_epi8(8));
}
template <>
JAXLLM_VNNI inline __m512i pair_bytes<Q4_1>(const uint8_t* qs, const uint8_t*) {
  return nibble_pair(qs);
}
template <>
JAXLLM_VNNI inline __m512i pair_bytes<Q5_0>(const uint8_t* qs, const uint8_t* qh) {
  return _mm512_sub_epi8(add_fifth_bits(nibble_pair(qs), qh), _mm512_set1_epi8(16));
}
template <>
JAXLLM_VNNI inline __m512i pair_bytes<Q5_1>(const uint8_t* qs, const uint8_t* qh) {
  return add_fifth_bits(nibble_pair(qs), qh);
}

// The activations as the VNNI tiles read them: q and s as above, and d expanded to 8 lanes
// per block ([M, nb, 8]: one 512-bit load covers two blocks' scales).
struct Activations512 {
  const int8_t* q;    // [M, K]
  const float* d8;    // [M, nb * 8]
  const float* s;     // [M, nb]
};

// m[b] * s[b] summed over the nb blocks of one weight row and one row of x.
JAXLLM_VNNI inline float min_term(const uint16_t* m, const float* s, int64_t nb) {
  __m512 acc = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; b += 16) {
    const __mmask16 k = nb - b >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (nb - b)) - 1);
    const __m512 mv = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(k, m + b));
    acc = _mm512_fmadd_ps(mv, _mm512_maskz_loadu_ps(k, s + b), acc);
  }
  return _mm512_reduce_add_ps(acc);
}

template <int MR, typename T>
JAXLLM_VNNI void row_tile_512(const Activations512& a, int64_t r0, int64_t K, const uint16_t* d, const uint16_t* m,
                              const uint8_t* qs, const uint8_t* qh, float* y, int64_t N) {
  const int64_t nb = K / kBlock;
  const __m512i both = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
  __m512 acc[MR];
  for (int r = 0; r < MR; ++r) acc[r] = _mm512_setzero_ps();
  int64_t b = 0;
  for (; b + 2 <= nb; b += 2) {
    __m512i w = pair_bytes<T>(qs + b * T::kQsBytes, qh + b * T::kQhBytes);
    __mmask64 neg = 0;
    if (T::kSigned) {   // |w| unsigned, its sign moved onto the activations
      neg = _mm512_movepi8_mask(w);
      w = _mm512_abs_epi8(w);
    }
    uint32_t d2;
    __builtin_memcpy(&d2, d + b, 4);
    const __m512 dw = _mm512_permutexvar_ps(both, _mm512_castps128_ps512(_mm_cvtph_ps(_mm_cvtsi32_si128(d2))));
#pragma GCC unroll 4
    for (int r = 0; r < MR; ++r) {
      const int64_t i = (r0 + r) * nb + b;
      __m512i qa = _mm512_loadu_si512(a.q + i * kBlock);
      if (T::kSigned) qa = _mm512_mask_sub_epi8(qa, neg, _mm512_setzero_si512(), qa);
      const __m512 p = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), w, qa));
      acc[r] = _mm512_fmadd_ps(p, _mm512_mul_ps(dw, _mm512_loadu_ps(a.d8 + i * 8)), acc[r]);
    }
  }
  float tail[MR] = {};
  if (b < nb) {   // an odd last block: the 8-lane form of the same products
    __m256i w = T::load(qs + b * T::kQsBytes, qh + b * T::kQhBytes);
    const __m256i wu = T::kSigned ? _mm256_sign_epi8(w, w) : w;
    const float db = f16(d[b]);
    for (int r = 0; r < MR; ++r) {
      const int64_t i = (r0 + r) * nb + b;
      __m256i qa = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.q + i * kBlock));
      if (T::kSigned) qa = _mm256_sign_epi8(qa, w);
      const __m256i p = _mm256_dpbusd_epi32(_mm256_setzero_si256(), wu, qa);
      tail[r] = db * a.d8[i * 8] * jaxllm_simd::hsum(_mm256_cvtepi32_ps(p));
    }
  }
  for (int r = 0; r < MR; ++r) {
    float v = _mm512_reduce_add_ps(acc[r]) + tail[r];
    if (T::kMin) v += min_term(m, a.s + (r0 + r) * nb, nb);
    y[r * N] = v;
  }
}

template <typename T>
JAXLLM_VNNI void tile_512(int rows, const Activations512& a, int64_t r0, int64_t K, const uint16_t* d,
                          const uint16_t* m, const uint8_t* qs, const uint8_t* qh, float* y, int64_t N) {
  switch (rows) {
    case 1: row_tile_512<1, T>(a, r0, K, d, m, qs, qh, y, N); break;
    case 2: row_tile_512<2, T>(a, r0, K, d, m, qs, qh, y, N); break;
    case 3: row_tile_512<3, T>(a, r0, K, d, m, qs, qh, y, N); break;
    default: row_tile_512<4, T>(a, r0, K, d, m, qs, qh, y, N); break;
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
  std::vector<float> d8;
  if (g_vnni) {
    d8.resize(M * nb * 8);
    for (int64_t i = 0; i < M * nb; ++i) std::fill_n(d8.data() + i * 8, 8, dx[i]);
  }
  const Activations512 a512{qx.data(), d8.data(), sx.data()};
  const bool vnni = g_vnni;
  const auto prefetch_row = [=](int64_t ahead) {
    jaxllm_gguf::prefetch(qs + ahead * nb * T::kQsBytes, nb * T::kQsBytes);
    jaxllm_gguf::prefetch(d + ahead * nb, nb * 2);
    if (m) jaxllm_gguf::prefetch(m + ahead * nb, nb * 2);
    if (T::kQhBytes) jaxllm_gguf::prefetch(qh + ahead * nb * T::kQhBytes, nb * T::kQhBytes);
  };
  if constexpr (std::is_same_v<T, Q4_1>) {
    if (!vnni && M == 1 && K >= kChunk * kBlock) {   // a shorter row has no whole chunk to convert at once
      split_rows(pool, M, N, [&](int64_t n0, int64_t n1) { q4_1_rows(a, K, d, m, qs, y, n0, n1, prefetch_row); });
      return;
    }
  }
  split_rows(pool, M, N, [&](int64_t n0, int64_t n1) {
    rows_range_prefetched(M, n0, n1, prefetch_row, [&](int rows, int64_t r0, int64_t n) {
      const uint16_t* mn = m ? m + n * nb : nullptr;
      if (vnni)
        tile_512<T>(rows, a512, r0, K, d + n * nb, mn, qs + n * nb * T::kQsBytes, qh + n * nb * T::kQhBytes,
                    y + r0 * N + n, N);
      else
        tile<T>(rows, a, r0, K, d + n * nb, mn, qs + n * nb * T::kQsBytes, qh + n * nb * T::kQhBytes,
                y + r0 * N + n, N);
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

// ---- AVX-512 VNNI over 16 interleaved weight rows (jaxllm/quant/native_matmul.py's
// interleave_rows): the layout that turns a matrix-vector product into vertical sums ----
//
// In the row-major tiles above every weight row ends in a horizontal reduction and every
// pair of blocks pays its unpacking and scale broadcasts for one output.  Here the weight
// rows come in groups of 16 (N % 16 == 0), and within a group each block's bytes are stored
// as [k][row][4]: 4 consecutive quant bytes of each of the 16 rows per 64 bytes, so one
// vpdpbusd multiplies them by the same 4 activation bytes (broadcast) and sums into one
// int32 lane per row.  A block is 8 such instructions per row of x (Q4: the low nibbles
// hold weights 4k..4k+3, the high ones 16+4k..), its 16 scales one f16 load, and the result
// is 16 outputs in one vector: no horizontal sums.  The scales' fields are [block][row] per
// group.  Integer sums per (row, block) equal the row-major tiles' exactly:
//   Q4_1:       sum(q * qa)                       (q = the nibble, 0..15)
//   Q4_0, Q8_0: sum(u * qa) - o * sum(qa)         (u = q + o unsigned: o = 8, 128)
// and y += d * dx * isum (+ m * sum(x)).
constexpr int kGroup = 16;

struct Interleaved {
  const int8_t* q;     // [M, K]
  const float* d;      // [M, nb]
  const float* s;      // [M, nb] float sums of x (the min term)
  const int32_t* is;   // [M, nb] integer sums of q (the offset term)
};

// The block's quant bytes of the group's 16 rows as unsigned bytes, k = 0..7: register k
// holds weights 4k..4k+3 of block order (Q4: k < 4 the low nibbles, k >= 4 the high ones,
// weights 16 + 4(k - 4)...).
template <typename T>
JAXLLM_VNNI inline void group_bytes(const uint8_t* qs, __m512i w[8]);

JAXLLM_VNNI inline void nibble_group(const uint8_t* qs, __m512i w[8]) {
  const __m512i mask = _mm512_set1_epi8(0x0F);
  for (int k = 0; k < 4; ++k) {
    const __m512i v = _mm512_loadu_si512(qs + 64 * k);
    w[k] = _mm512_and_si512(v, mask);
    w[k + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), mask);
  }
}
template <>
JAXLLM_VNNI inline void group_bytes<Q4_0>(const uint8_t* qs, __m512i w[8]) { nibble_group(qs, w); }
template <>
JAXLLM_VNNI inline void group_bytes<Q4_1>(const uint8_t* qs, __m512i w[8]) { nibble_group(qs, w); }
template <>
JAXLLM_VNNI inline void group_bytes<Q8_0>(const uint8_t* qs, __m512i w[8]) {
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));   // q + 128 as unsigned bytes
  for (int k = 0; k < 8; ++k) w[k] = _mm512_xor_si512(_mm512_loadu_si512(qs + 64 * k), flip);
}
// The offset group_bytes added to every quant (the quants are u - offset).
template <typename T> constexpr int kOffset = 0;
template <> constexpr int kOffset<Q4_0> = 8;
template <> constexpr int kOffset<Q8_0> = 128;

// Activation bytes of register k's weights within a 32-value block.
template <typename T>
constexpr int act_offset(int k) {
  return T::kQsBytes == 16 ? (k < 4 ? 4 * k : 16 + 4 * (k - 4)) : 4 * k;
}

inline int32_t load_i32(const int8_t* p) {
  int32_t v;
  __builtin_memcpy(&v, p, 4);
  return v;
}

// y[r, 16g .. 16g + 15] for r < MR rows of x (starting at r0) and weight group g.
template <int MR, typename T>
JAXLLM_VNNI void group_tile(const Interleaved& a, int64_t r0, int64_t K, const uint16_t* d, const uint16_t* m,
                            const uint8_t* qs, float* y, int64_t N) {
  const int64_t nb = K / kBlock;
  constexpr int64_t kGroupBytes = kGroup * T::kQsBytes;
  __m512 acc[MR];
  for (int r = 0; r < MR; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    __m512i w[8];
    group_bytes<T>(qs + b * kGroupBytes, w);
    const __m512 dv = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(d + b * kGroup)));
    __m512 mv;
    if (T::kMin) mv = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(m + b * kGroup)));
#pragma GCC unroll 4
    for (int r = 0; r < MR; ++r) {
      const int64_t i = (r0 + r) * nb + b;
      const int8_t* qa = a.q + i * kBlock;
      // two chains of 4 dependent sums each; consecutive blocks' chains are independent
      __m512i s0 = _mm512_setzero_si512(), s1 = _mm512_setzero_si512();
#pragma GCC unroll 8
      for (int k = 0; k < 8; k += 2) {
        s0 = _mm512_dpbusd_epi32(s0, w[k], _mm512_set1_epi32(load_i32(qa + act_offset<T>(k))));
        s1 = _mm512_dpbusd_epi32(s1, w[k + 1], _mm512_set1_epi32(load_i32(qa + act_offset<T>(k + 1))));
      }
      __m512i s = _mm512_add_epi32(s0, s1);
      if (kOffset<T>) s = _mm512_sub_epi32(s, _mm512_set1_epi32(kOffset<T> * a.is[i]));
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(dv, _mm512_set1_ps(a.d[i])), acc[r]);
      if (T::kMin) acc[r] = _mm512_fmadd_ps(mv, _mm512_set1_ps(a.s[i]), acc[r]);
    }
  }
  for (int r = 0; r < MR; ++r) _mm512_storeu_ps(y + r * N, acc[r]);
}

// f(std::integral_constant<int, rows>) for rows 1 .. 7, and 8 for more: a tile's row count
// as the template argument its kernel is unrolled for.
template <typename F>
inline void with_rows(int rows, F f) {
  switch (rows) {
    case 1: f(std::integral_constant<int, 1>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    case 3: f(std::integral_constant<int, 3>{}); break;
    case 4: f(std::integral_constant<int, 4>{}); break;
    case 5: f(std::integral_constant<int, 5>{}); break;
    case 6: f(std::integral_constant<int, 6>{}); break;
    case 7: f(std::integral_constant<int, 7>{}); break;
    default: f(std::integral_constant<int, 8>{}); break;
  }
}

template <typename T>
JAXLLM_VNNI void group_tiles(int rows, const Interleaved& a, int64_t r0, int64_t K, const uint16_t* d,
                             const uint16_t* m, const uint8_t* qs, float* y, int64_t N) {
  with_rows(rows, [&](auto mr) { group_tile<decltype(mr)::value, T>(a, r0, K, d, m, qs, y, N); });
}

// Rows of x per group tile: 8 accumulators + a block's 8 weight registers + 2 partial sums,
// the scales and the broadcasts fit AVX-512's 32 registers.
constexpr int kGroupRows = 8;

// ---------------------------------------------------------------- AMX over the same groups
//
// Where the CPU has AMX (Sapphire Rapids and later) and a call has at least kAmxMinRows
// rows of x, one TDPBSSD computes a block's int8 sums for 16 rows of x and a group's 16
// weight rows at once: the interleaved layout, [k/4][row][4] bytes per block, is exactly an
// AMX B tile (8 rows of 64 bytes), and a block of 16 rows of x is an A tile (16 rows of 32
// bytes, the row stride K).  Q4 nibbles and Q8_0 quants are signed bytes as they are (no
// offset).  The integer sums are those of the VNNI tile (Q8_0: sum(q * qx), where VNNI takes
// (q + 128) * qx less 128 * sum(qx)), and the float scaling below is the VNNI tile's, op for
// op and block by block, so the result is the same bits: a row's output does not depend on
// how many rows the step has, which speculation's exactness relies on.  Up to 4 blocks are in
// flight (tiles 0-3 accumulate, 4-5 hold x, 6-7 the weights).
#if defined(__linux__) && defined(__x86_64__) && ((defined(__clang__) && __clang_major__ >= 12) || \
                                                (!defined(__clang__) && defined(__GNUC__) && __GNUC__ >= 11))
#define JAXLLM_AMX_BUILD 1
#define JAXLLM_AMX \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c,amx-tile,amx-int8")))

bool detect_amx() {
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!kHasVnni || !__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
  if (!((d >> 24) & 1) || !((d >> 25) & 1)) return false;   // AMX-TILE, AMX-INT8
  // Linux hands a process the tile state only on request (ARCH_REQ_XCOMP_PERM, XTILEDATA).
  return syscall(SYS_arch_prctl, 0x1023, 18) == 0;
}
#else
#define JAXLLM_AMX_BUILD 0
bool detect_amx() { return false; }
#endif
const bool kHasAmx = detect_amx();
bool g_amx = kHasAmx;
// Below this many rows of x the VNNI tile is as fast or faster: the float scaling of every
// block sum, which both paths share, costs more than the products AMX saves (measured on
// the built-in model's shapes: 0.8x at 4-9 rows, 1.0x at 16, 1.15-1.2x at 64-128).
constexpr int64_t kAmxMinRows = 32;
constexpr int kAmxRows = 16;
constexpr int64_t kBlockBytes = kGroup * kBlock;   // a group's block as signed bytes: one B tile

#if JAXLLM_AMX_BUILD
struct TileConfig {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

JAXLLM_AMX void amx_config() {
  TileConfig c{};
  c.palette = 1;
  for (int t = 0; t < 4; ++t) c.rows[t] = kAmxRows, c.colsb[t] = 64;   // int32 sums [16 x rows][16 w rows]
  for (int t = 4; t < 6; ++t) c.rows[t] = kAmxRows, c.colsb[t] = 32;   // x: a block of 16 rows
  for (int t = 6; t < 8; ++t) c.rows[t] = 8, c.colsb[t] = 64;          // w: a block of the group
  _tile_loadconfig(&c);
}

// The group's blocks as signed bytes in B-tile order ([nb][k 8][row 16][4]): Q8_0's are its
// bytes; Q4's nibbles are unpacked (register k of group_bytes is B row k: its activation
// bytes are 4k..4k+3 of the block for every type, see act_offset).
template <typename T>
JAXLLM_AMX const int8_t* amx_weights(const uint8_t* qs, int64_t nb, int8_t* scratch) {
  if (T::kQsBytes == 32) return reinterpret_cast<const int8_t*>(qs);
  for (int64_t b = 0; b < nb; ++b) {
    __m512i w[8];
    nibble_group(qs + b * kGroup * T::kQsBytes, w);
    for (int k = 0; k < 8; ++k) _mm512_storeu_si512(scratch + b * kBlockBytes + 64 * k, w[k]);
  }
  return scratch;
}

// y[r0 .. r0 + rows, 16g .. 16g + 15]; x (a.q) holds at least r0 + 16 rows (zero padding).
template <typename T>
JAXLLM_AMX void amx_group_tile(const Interleaved& a, int64_t r0, int rows, int64_t K, const uint16_t* d,
                               const uint16_t* m, const int8_t* w, float* y, int64_t N, int32_t* c) {
  const int64_t nb = K / kBlock;
  const int8_t* x = a.q + r0 * K;
  __m512 acc[kAmxRows];
  for (int r = 0; r < kAmxRows; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; b += 4) {
    const int64_t n = std::min<int64_t>(4, nb - b);
    // tile numbers are immediates: the four blocks spelled out
    _tile_zero(0);
    _tile_loadd(4, x + b * kBlock, K);
    _tile_loadd(6, w + b * kBlockBytes, 64);
    _tile_dpbssd(0, 4, 6);
    if (n > 1) {
      _tile_zero(1);
      _tile_loadd(5, x + (b + 1) * kBlock, K);
      _tile_loadd(7, w + (b + 1) * kBlockBytes, 64);
      _tile_dpbssd(1, 5, 7);
    }
    if (n > 2) {
      _tile_zero(2);
      _tile_loadd(4, x + (b + 2) * kBlock, K);
      _tile_loadd(6, w + (b + 2) * kBlockBytes, 64);
      _tile_dpbssd(2, 4, 6);
    }
    if (n > 3) {
      _tile_zero(3);
      _tile_loadd(5, x + (b + 3) * kBlock, K);
      _tile_loadd(7, w + (b + 3) * kBlockBytes, 64);
      _tile_dpbssd(3, 5, 7);
    }
    _tile_stored(0, c, 64);
    if (n > 1) _tile_stored(1, c + 256, 64);
    if (n > 2) _tile_stored(2, c + 512, 64);
    if (n > 3) _tile_stored(3, c + 768, 64);
    for (int64_t j = 0; j < n; ++j) {
      const __m512 dv = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(d + (b + j) * kGroup)));
      __m512 mv;
      if (T::kMin)
        mv = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(m + (b + j) * kGroup)));
      for (int r = 0; r < rows; ++r) {
        const int64_t i = (r0 + r) * nb + b + j;
        __m512i s = _mm512_loadu_si512(c + j * 256 + r * 16);
        if (kOffset<T> == 8) s = _mm512_sub_epi32(s, _mm512_set1_epi32(8 * a.is[i]));   // Q4_0: q - 8
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(dv, _mm512_set1_ps(a.d[i])), acc[r]);
        if (T::kMin) acc[r] = _mm512_fmadd_ps(mv, _mm512_set1_ps(a.s[i]), acc[r]);
      }
    }
  }
  for (int r = 0; r < rows; ++r) _mm512_storeu_ps(y + r * N, acc[r]);
}

template <typename T>
JAXLLM_AMX void amx_groups(const Interleaved& a, int64_t M, int64_t K, const uint16_t* d, const uint16_t* m,
                           const uint8_t* qs, float* y, int64_t N, int64_t g0, int64_t g1) {
  const int64_t nb = K / kBlock, group_qs = nb * kGroup * T::kQsBytes, group_d = nb * kGroup;
  std::vector<int8_t> scratch(T::kQsBytes == 32 ? 0 : nb * kBlockBytes);
  alignas(64) int32_t c[4 * kAmxRows * 16];
  amx_config();   // per thread: the pool's threads each hold their own tile state
  for (int64_t g = g0; g < g1; ++g) {
    const int8_t* w = amx_weights<T>(qs + g * group_qs, nb, scratch.data());
    for (int64_t r0 = 0; r0 < M; r0 += kAmxRows)
      amx_group_tile<T>(a, r0, static_cast<int>(std::min<int64_t>(kAmxRows, M - r0)), K, d + g * group_d,
                        m ? m + g * group_d : nullptr, w, y + r0 * N + g * kGroup, N, c);
  }
  _tile_release();
}
#endif

// The groups [0, groups) split over the pool; within a part, group by group, tile(rows, r0,
// g) for each tile of at most max_rows rows of x (rows r0 .. r0 + rows), the fields of the
// groups two ahead requested.  A group is 16 weight rows: 2 groups ahead is about the rows
// ahead of the row-major tiles.  The group is the outer loop: its bytes (16 rows, 6-10 KiB at
// K = 576) stay in L1 for every tile of x, so the weights stream from memory once whatever M
// is (tiles outside would stream them once per tile: 3x the time of the 30 MB tied head at M = 8).
template <typename Tile>
void walk_groups(ffi::ThreadPool& pool, int64_t M, int64_t groups, int max_rows, const uint8_t* qs, int64_t group_qs,
                 const uint16_t* d, const uint16_t* m, int64_t group_d, const Tile& tile) {
  const auto prefetch_group = [=](int64_t g) {
    jaxllm_gguf::prefetch(qs + g * group_qs, group_qs);
    jaxllm_gguf::prefetch(d + g * group_d, group_d * 2);
    if (m) jaxllm_gguf::prefetch(m + g * group_d, group_d * 2);
  };
  split_rows(pool, M, groups, [&](int64_t g0, int64_t g1) {
    const int64_t tiles = (M + max_rows - 1) / max_rows;
    for (int64_t g = g0; g < std::min(g1, g0 + 2); ++g) prefetch_group(g);
    for (int64_t g = g0; g < g1; ++g) {
      if (g + 2 < g1) prefetch_group(g + 2);
      int64_t r0 = 0;
      for (int64_t t = 0; t < tiles; ++t) {
        // tiles as even as possible (9 rows: 5 + 4, not 8 + 1)
        const int rows = static_cast<int>(M / tiles + (t < M % tiles));
        tile(rows, r0, g);
        r0 += rows;
      }
    }
  });
}

template <typename T>
void linear_interleaved(ffi::ThreadPool& pool, const float* x, const uint16_t* d, const uint16_t* m,
                        const uint8_t* qs, float* y, int64_t M, int64_t K, int64_t N) {
  const int64_t nb = K / kBlock, groups = N / kGroup;
  const bool amx = g_amx && M >= kAmxMinRows;
  // AMX reads x in tiles of 16 rows: the rows past M are zeros.
  std::vector<int8_t> qx((amx ? (M + kAmxRows - 1) / kAmxRows * kAmxRows : M) * K);
  std::vector<float> dx(M * nb), sx(M * nb);
  std::vector<int32_t> isx(M * nb);
  quantize_rows(x, M, K, qx.data(), dx.data(), sx.data());
  for (int64_t i = 0; i < M * nb; ++i) {
    int32_t t = 0;
    for (int j = 0; j < kBlock; ++j) t += qx[i * kBlock + j];
    isx[i] = t;
  }
  const Interleaved a{qx.data(), dx.data(), sx.data(), isx.data()};
  const int64_t group_qs = nb * kGroup * T::kQsBytes, group_d = nb * kGroup;
#if JAXLLM_AMX_BUILD
  if (amx) {
    split_rows(pool, M, groups, [&](int64_t g0, int64_t g1) { amx_groups<T>(a, M, K, d, m, qs, y, N, g0, g1); });
    return;
  }
#endif
  walk_groups(pool, M, groups, kGroupRows, qs, group_qs, d, m, group_d, [&](int rows, int64_t r0, int64_t g) {
    group_tiles<T>(rows, a, r0, K, d + g * group_d, m ? m + g * group_d : nullptr, qs + g * group_qs,
                   y + r0 * N + g * kGroup, N);
  });
}

// The interleaved targets' handler: operands checked, then linear (linear_interleaved<T>, or
// linear_i16_interleaved<T> for int16 activations) on them.
template <typename T, typename Linear>
ffi::Error RunInterleaved(const char* name, ffi::ThreadPool& pool, ffi::Buffer<ffi::F32>& x,
                          ffi::Buffer<ffi::U16>& d, const uint16_t* m, ffi::Span<const int64_t> md,
                          ffi::Buffer<ffi::U8>& qs, ffi::ResultBuffer<ffi::F32>& y, Linear linear) {
  auto xd = x.dimensions();
  auto dd = d.dimensions();
  if (auto e = check(name, xd, dd, qs.dimensions(), T::kQsBytes); e.failure()) return e;
  if (T::kMin)
    if (auto e = check_like_d(name, "m", dd, md, 0); e.failure()) return e;
  if (dd[0] % kGroup != 0)
    return ffi::Error::InvalidArgument(std::string(name) + ": the interleaved layout needs N % 16 == 0");
  if (!kHasVnni)
    return ffi::Error::InvalidArgument(std::string(name) + ": the interleaved layout needs AVX512F/BW/VNNI");
  linear(pool, x.typed_data(), d.typed_data(), m, qs.typed_data(), y->typed_data(), xd[0], xd[1], dd[0]);
  return ffi::Error::Success();
}

ffi::Error Dot16Q8_0(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U16> d, ffi::Buffer<ffi::U8> qs,
                     ffi::ResultBuffer<ffi::F32> y) {
  return RunInterleaved<Q8_0>("jaxllm_dot16_q8_0", pool, x, d, nullptr, {}, qs, y, linear_interleaved<Q8_0>);
}

ffi::Error Dot16Q4_0(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U16> d, ffi::Buffer<ffi::U8> qs,
                     ffi::ResultBuffer<ffi::F32> y) {
  return RunInterleaved<Q4_0>("jaxllm_dot16_q4_0", pool, x, d, nullptr, {}, qs, y, linear_interleaved<Q4_0>);
}

ffi::Error Dot16Q4_1(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U16> d, ffi::Buffer<ffi::U16> m,
                     ffi::Buffer<ffi::U8> qs, ffi::ResultBuffer<ffi::F32> y) {
  return RunInterleaved<Q4_1>("jaxllm_dot16_q4_1", pool, x, d, m.typed_data(), m.dimensions(), qs, y,
                              linear_interleaved<Q4_1>);
}

// ---- int16 activations over 16 interleaved weight rows (AVX-512 VNNI): Q4_1 and Q8_0 ----
//
// jaxllm_dot_i16_q4_1's arithmetic (x rounded to int16 per 32 values, exact integer block
// sums, one float scaling per block) in the interleaved layout of the jaxllm_dot16_* targets:
// one vpdpwssd multiplies a pair of 16-bit weights of each of the group's 16 rows by the same
// pair of activations (broadcast) and adds both products into that row's int32 lane, so a
// block is 16 of them per row of x and a row's result is one lane: no horizontal sums, and no
// widening panels (the quants are split in registers once per block for every tile of x).
// A block's group bytes are 64-byte words [row][4 bytes]; I16Q4_1 and I16Q8_0 below turn
// them into the 16 registers of 16-bit weight pairs and name the pair of x each one meets.
// x's int16 blocks are stored with each 4 values in the order (0, 2, 1, 3), which puts every
// pair side by side (one 32-bit broadcast).  Per (row of x, weight row) the float operations
// are, block by block in order,
//   acc = fma(float(isum_b), d_b * dx_b, acc);  [Q4_1: acc = fma(m_b, sx_b, acc)]
// whatever the number of rows of x or the rows sharing a tile: a token's logits are the same
// bits in every step shape (tests/kernels/test_cpu_quant_dot.py).  On an AMD EPYC Zen 5 core
// the Q4_1 tile ran 2.2-2.5x the float32 panels' multiply-adds per second (docs/BENCHMARKS.md,
// "int16 activations over interleaved rows"); on a Zen 4 the Q8_0 one (the built-in model's
// tied LM head) 2.0x the float32 walk at one row ("The LM head by int16 activations").
constexpr int kGroupRows16 = 8;   // rows of x per tile: 8 accumulators + 16 weight registers

inline int32_t load_i32(const int16_t* p) {
  int32_t v;
  __builtin_memcpy(&v, p, 4);
  return v;
}

// Q4_1: the k-th word's bytes j hold weight 4k + j in their low nibble and 16 + 4k + j in
// their high one; three ands and three shifts give the 16-bit lanes
//   w[4k]: weights (4k, 4k + 2)        w[4k + 1]: (4k + 1, 4k + 3)
//   w[4k + 2]: (16 + 4k, 16 + 4k + 2)  w[4k + 3]: (16 + 4k + 1, 16 + 4k + 3)
// A block's integer sum is at most 32 * 15 * 32767 < 2^24: exact in int32 and in the float
// conversion, so it equals jaxllm_dot_i16_q4_1's.
struct I16Q4_1 {
  static constexpr int64_t kQsBytes = Q4_1::kQsBytes;
  static constexpr bool kMin = true;
  static JAXLLM_VNNI inline void unpack(const uint8_t* qs, __m512i w[16]) {
    const __m512i low = _mm512_set1_epi32(0x000F000F);
#pragma GCC unroll 4
    for (int k = 0; k < 4; ++k) {
      const __m512i v = _mm512_loadu_si512(qs + 64 * k);
      w[4 * k] = _mm512_and_si512(v, low);
      w[4 * k + 1] = _mm512_and_si512(_mm512_srli_epi16(v, 8), low);
      w[4 * k + 2] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
      w[4 * k + 3] = _mm512_srli_epi16(v, 12);
    }
  }
  // where register j's pair of x starts in the paired block
  static constexpr int x_at(int j) { return (j % 4 >= 2 ? 16 : 0) + 4 * (j / 4) + (j % 2 ? 2 : 0); }
};

// Q8_0: the k-th word holds weights 4k .. 4k + 3 of each row as int8; sign-extended into
// 16-bit lanes by a shift pair and a shift,
//   w[2k]: weights (4k, 4k + 2)        w[2k + 1]: (4k + 1, 4k + 3)
// A block's integer sum is at most 32 * 128 * 32767 < 2^31: exact in int32 (its float
// conversion rounds past 2^24, the same way in every tile).
struct I16Q8_0 {
  static constexpr int64_t kQsBytes = Q8_0::kQsBytes;
  static constexpr bool kMin = false;
  static JAXLLM_VNNI inline void unpack(const uint8_t* qs, __m512i w[16]) {
#pragma GCC unroll 8
    for (int k = 0; k < 8; ++k) {
      const __m512i v = _mm512_loadu_si512(qs + 64 * k);
      w[2 * k] = _mm512_srai_epi16(_mm512_slli_epi16(v, 8), 8);
      w[2 * k + 1] = _mm512_srai_epi16(v, 8);
    }
  }
  static constexpr int x_at(int j) { return 4 * (j / 2) + (j % 2 ? 2 : 0); }
};

// y[r, 16g .. 16g + 15] for r < MR rows of x (a.q etc. from row r0) and one group of 16 rows
// (m: null for the types without a min).
template <typename W, int MR>
JAXLLM_VNNI void group_tile16(const Activations16& a, int64_t r0, int64_t K, const uint16_t* d, const uint16_t* m,
                              const uint8_t* qs, float* y, int64_t N) {
  const int64_t nb = K / kBlock;
  constexpr int64_t kGroupBytes = kGroup * W::kQsBytes;
  constexpr int kChains = MR <= 2 ? 8 : 2;
  __m512 acc[MR];
  for (int r = 0; r < MR; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    __m512i w[16];
    W::unpack(qs + b * kGroupBytes, w);
    const __m512 dv = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(d + b * kGroup)));
    __m512 mv = _mm512_setzero_ps();
    if constexpr (W::kMin) mv = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(m + b * kGroup)));
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      const int64_t i = (r0 + r) * nb + b;
      const int16_t* qa = a.q + i * kBlock;
      // kChains independent sums (a few rows of x have too few other chains to hide the
      // instruction's latency behind); integer adds: their order does not change the sum
      __m512i c[kChains];
      for (int j = 0; j < kChains; ++j) c[j] = _mm512_setzero_si512();
#pragma GCC unroll 16
      for (int j = 0; j < 16; ++j)
        c[j % kChains] = _mm512_dpwssd_epi32(c[j % kChains], w[j], _mm512_set1_epi32(load_i32(qa + W::x_at(j))));
      for (int j = 2; j < kChains; j += 2) {
        c[0] = _mm512_add_epi32(c[0], c[j]);
        c[1] = _mm512_add_epi32(c[1], c[j + 1]);
      }
      const __m512i s = _mm512_add_epi32(c[0], c[1]);
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(dv, _mm512_set1_ps(a.d[i])), acc[r]);
      if constexpr (W::kMin) acc[r] = _mm512_fmadd_ps(mv, _mm512_set1_ps(a.s[i]), acc[r]);
    }
  }
  for (int r = 0; r < MR; ++r) _mm512_storeu_ps(y + r * N, acc[r]);
}

// y = x . W^T: x rounded once, then the groups walked as linear_interleaved's.
template <typename W>
void linear_i16_interleaved(ffi::ThreadPool& pool, const float* x, const uint16_t* d, const uint16_t* m,
                            const uint8_t* qs, float* y, int64_t M, int64_t K, int64_t N) {
  const int64_t nb = K / kBlock, groups = N / kGroup;
  std::vector<int16_t> qx(M * K);
  std::vector<float> dx(M * nb), sx(M * nb);
  quantize_rows16<true>(x, M, K, qx.data(), dx.data(), sx.data());
  const Activations16 a{qx.data(), dx.data(), sx.data()};
  const int64_t group_qs = nb * kGroup * W::kQsBytes, group_d = nb * kGroup;
  walk_groups(pool, M, groups, kGroupRows16, qs, group_qs, d, m, group_d, [&](int rows, int64_t r0, int64_t g) {
    with_rows(rows, [&](auto mr) {
      group_tile16<W, decltype(mr)::value>(a, r0, K, d + g * group_d, m ? m + g * group_d : nullptr,
                                           qs + g * group_qs, y + r0 * N + g * kGroup, N);
    });
  });
}

// x, d, [m], qs as jaxllm_dot16_q4_1's / _q8_0's (the fields interleaved); int16 activations.
ffi::Error Dot16I16Q4_1(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U16> d,
                        ffi::Buffer<ffi::U16> m, ffi::Buffer<ffi::U8> qs, ffi::ResultBuffer<ffi::F32> y) {
  return RunInterleaved<I16Q4_1>("jaxllm_dot16_i16_q4_1", pool, x, d, m.typed_data(), m.dimensions(), qs, y,
                                 linear_i16_interleaved<I16Q4_1>);
}

ffi::Error Dot16I16Q8_0(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U16> d,
                        ffi::Buffer<ffi::U8> qs, ffi::ResultBuffer<ffi::F32> y) {
  return RunInterleaved<I16Q8_0>("jaxllm_dot16_i16_q8_0", pool, x, d, nullptr, {}, qs, y,
                                 linear_i16_interleaved<I16Q8_0>);
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

// x, d, m, qs as jaxllm_dot_q4_1's; int16 activations (linear_q4_1_i16).
ffi::Error DotI16Q4_1(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U16> d, ffi::Buffer<ffi::U16> m,
                      ffi::Buffer<ffi::U8> qs, ffi::ResultBuffer<ffi::F32> y) {
  const char* name = "jaxllm_dot_i16_q4_1";
  auto xd = x.dimensions();
  auto dd = d.dimensions();
  if (auto e = check(name, xd, dd, qs.dimensions(), Q4_1::kQsBytes); e.failure()) return e;
  if (auto e = check_like_d(name, "m", dd, m.dimensions(), 0); e.failure()) return e;
  linear_q4_1_i16(pool, x.typed_data(), d.typed_data(), m.typed_data(), qs.typed_data(), y->typed_data(), xd[0],
                  xd[1], dd[0]);
  return ffi::Error::Success();
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

// Selects the VNNI tiles (on == 1, where the CPU has them) or the AVX2 ones for every later
// call; returns whether the VNNI tiles are now in use.
extern "C" int jaxllm_quant_dot_set_avx512(int on) {
  g_vnni = on && kHasVnni;
  return g_vnni;
}

// Selects AMX for the interleaved targets' calls of kAmxMinRows rows or more (on == 1, where
// the CPU and the OS allow it) or the VNNI tiles; returns whether AMX is now in use.
extern "C" int jaxllm_quant_dot_set_amx(int on) {
  g_amx = on && kHasAmx;
  return g_amx;
}

extern "C" int jaxllm_quant_dot_has_amx() { return kHasAmx; }

// Whether the CPU runs the interleaved (jaxllm_dot16_*) targets.
extern "C" int jaxllm_quant_dot_has_vnni() { return kHasVnni; }

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

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxllmDotI16Q4_1, DotI16Q4_1,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U16>>()
                                  .Arg<ffi::Buffer<ffi::U16>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

// The interleaved layout's targets: operands as above (x, d, [m], qs), the fields interleaved.
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxllmDot16Q8_0, Dot16Q8_0,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U16>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxllmDot16Q4_0, Dot16Q4_0,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U16>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxllmDot16Q4_1, Dot16Q4_1,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U16>>()
                                  .Arg<ffi::Buffer<ffi::U16>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxllmDot16I16Q4_1, Dot16I16Q4_1,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U16>>()
                                  .Arg<ffi::Buffer<ffi::U16>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxllmDot16I16Q8_0, Dot16I16Q8_0,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U16>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
