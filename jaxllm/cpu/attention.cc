// Native CPU paged attention for XLA: the function of paged_attention_xla
// (jaxllm/layers/attention.py), reading a paged KV cache that write_kv has already updated.
//
// XLA:CPU runs the plain-XLA path as gathers of whole 128-position K/V chunks per token
// (transpose copies) and tiny batched einsums: at batch 32 with ~100-token contexts that
// measured 1.0-2.9 ms per layer for ~1.2 MB of cache and ~7 MFLOP (docs/architecture.md).  Here a
// work item is (tile of query tokens, KV head): a decode token alone, or up to kRows / G
// consecutive tokens of a prefill chunk, with all G = Hq / Hkv query heads of that KV head.
// It walks the key tiles its tokens may see through the sequence's block table, reads each
// tile's K/V rows once for all of its query rows (flash-style: scores as a small
// rows x keys product, exact softmax with a running maximum and sum per row, then P.V), and
// keeps its state in float32 scratch that stays in cache.  A token's result is the same bits
// in any tile (see attend_tile).  Items are spread over XLA's intra-op thread pool by
// parallel.h, as linear.cc's panels are.  Called from jaxllm/cpu/attention.py via XLA's FFI.
//
//   q            [T, Hq, Dh]              float32
//   k/v cache    [NB, BS, Hkv, Dh]        float32 or uint16 (bfloat16 bits, see formats/storage.py),
//                or [L, NB, BS, Hkv, Dh]  stacked over layers, read at layer[]; or quantized
//                (--kv-cache-dtype, layers/kv_quant.py): int8 with k/v scales [.., Hkv, 1]
//                float16 beside it, or fp8 e4m3fn / e5m2 as uint8 bits (scale 1.0)
//   block_tables [S, MB] int32, token_seq [T] int32, positions [T] int32, layer [] int32
//   visible_upto [T] int32, only in the *_vis targets: the last position each query may see
//                (Gemma 3's image tokens see their whole image); the causal targets take none,
//                so the text-only programs keep their operands and their code path
//   sinks        [Hq] float32 (GPT-OSS's attention sinks: a logit per query head that joins the
//                softmax's denominator) or [0]: none
//   attrs        scale (f32), sliding_window (i64; <= 0: none), soft_cap (f32; <= 0: none:
//                otherwise scores become soft_cap * tanh(s / soft_cap), Gemma 2)
//   out          [T, Hq, Dh]              float32
//
// A quantized row is widened by a load that knows its format (int8: sign extension; fp8: a
// 256-entry table built from the format's bits); an int8 row's scale is constant along
// head_dim, so it multiplies the row's score (K) and its softmax weight (V) instead of
// every element.
//
// Token t of sequence s = token_seq[t] attends over positions [lo, hi] with
// hi = positions[t] (causal) or max(positions[t], visible_upto[t]) (the *_vis targets), and
// lo = max(0, positions[t] + 1 - sliding_window) (or 0): the window counts back from the
// token's own position; position p lives in block block_tables[s, p / BS] at offset p % BS.
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "parallel.h"
#include "simd.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// KV positions per softmax step: one running-max update and one rescale of the
// accumulators per tile instead of per position; 32 rows of row pointers and G x 32
// scores stay in L1.
constexpr int64_t kTile = 32;
// Query heads handled per pass over a tile: 4 heads x 2 rows (scores) or 4 heads x 2
// column vectors (values) of accumulators, plus operands, fit in the 16 AVX registers.
constexpr int kHeads = 4;

using jaxllm_simd::hmax;
using jaxllm_simd::hsum;
using jaxllm_simd::load8;
using jaxllm_simd::to_f32;

// fp8 values as their bytes; one type per format, so the loads below pick the table.
struct Fp8E4M3 { uint8_t bits; };
struct Fp8E5M2 { uint8_t bits; };

// The 256 values of an fp8 format with `man_bits` mantissa bits and exponent bias `bias`
// (e4m3fn: 3, 7, S.1111.111 is NaN, no infinity; e5m2: 2, 15, IEEE-like inf/NaN).
struct Fp8Table {
  alignas(32) float v[256];
  Fp8Table(int man_bits, int bias, bool ieee_specials) {
    const int exp_bits = 7 - man_bits, emax = (1 << exp_bits) - 1, mmask = (1 << man_bits) - 1;
    for (int b = 0; b < 256; ++b) {
      const int e = (b >> man_bits) & emax, m = b & mmask;
      float x;
      if (e == 0) {
        x = std::ldexp(static_cast<float>(m), 1 - bias - man_bits);                 // subnormal
      } else if (ieee_specials && e == emax) {
        x = m ? NAN : INFINITY;
      } else if (!ieee_specials && e == emax && m == mmask) {
        x = NAN;
      } else {
        x = std::ldexp(1.f + static_cast<float>(m) / (1 << man_bits), e - bias);
      }
      v[b] = (b & 0x80) ? -x : x;
    }
  }
};
const Fp8Table kE4M3(3, 7, false);
const Fp8Table kE5M2(2, 15, true);

inline __m256 load8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline __m256 load8_table(const uint8_t* p, const float* table) {
  const __m256i idx = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  return _mm256_i32gather_ps(table, idx, 4);
}
inline __m256 load8(const Fp8E4M3* p) { return load8_table(&p->bits, kE4M3.v); }
inline __m256 load8(const Fp8E5M2* p) { return load8_table(&p->bits, kE5M2.v); }
inline float to_f32(int8_t v) { return static_cast<float>(v); }
inline float to_f32(Fp8E4M3 v) { return kE4M3.v[v.bits]; }
inline float to_f32(Fp8E5M2 v) { return kE5M2.v[v.bits]; }

// float16 bits -> float32 (the int8 scales; this source is built without F16C).
inline float half_to_f32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16, e = (h >> 10) & 0x1f, m = h & 0x3ff;
  if (e == 0) {
    const float x = static_cast<float>(m) * 5.9604644775390625e-8f;   // m * 2^-24
    return sign ? -x : x;
  }
  const uint32_t bits = sign | (e == 31 ? 0x7f800000u | (m << 13) : ((e + 112) << 23) | (m << 13));
  float f;
  __builtin_memcpy(&f, &bits, 4);
  return f;
}

// Both horizontal sums at once: one shuffle tree for two rows' dot products.
inline void hsum2(__m256 a, __m256 b, float* x, float* y) {
  const __m256 h = _mm256_hadd_ps(a, b);   // a01 a23 b01 b23 | a45 a67 b45 b67
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
  s = _mm_hadd_ps(s, s);                   // a b a b
  *x = _mm_cvtss_f32(s);
  *y = _mm_cvtss_f32(_mm_shuffle_ps(s, s, 1));
}

// exp of 8 lanes (Cephes' expf: x = n ln2 + r, degree-5 polynomial in r), relative error
// about 1e-7 where the result is a normal float; inputs below -88.37 (and -inf) give 0.
// A scalar expf per score cost as much as the dot products it normalises.
inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(x, _mm256_set1_ps(88.3762626647949f));
  x = _mm256_max_ps(x, _mm256_set1_ps(-88.3762626647949f));
  __m256 fx = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
  // r = x - n ln2, with ln2 split in two so that n ln2 is exact enough.
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), x);
  y = _mm256_add_ps(y, _mm256_set1_ps(1.0f));
  // 2^n from the exponent bits; n = -127 (the clamp's floor) gives +0.
  __m256i n = _mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(127));
  return _mm256_mul_ps(y, _mm256_castsi256_ps(_mm256_slli_epi32(n, 23)));
}

// One row's kTile scores s (keys it may not see already -inf) -> exp(s - m_new) in place,
// m_new = max(m_old, max s); *sum = their sum: 8-lane sums over the tile in key order
// (lane i: keys i, i + 8, i + 16, i + 24), then hsum's tree.  Returns m_new.
inline float exp_row(float* s, float m_old, float* sum) {
  static_assert(kTile == 32, "exp_row512 splits the tile into two 16-key halves");
  __m256 mx = _mm256_set1_ps(-INFINITY);
  for (int64_t j = 0; j < kTile; j += 8) mx = _mm256_max_ps(mx, _mm256_loadu_ps(s + j));
  const float m_new = std::max(m_old, hmax(mx));
  const __m256 mv = _mm256_set1_ps(m_new);
  __m256 acc = _mm256_setzero_ps();
  for (int64_t j = 0; j < kTile; j += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + j), mv));
    _mm256_storeu_ps(s + j, e);
    acc = _mm256_add_ps(acc, e);
  }
  *sum = hsum(acc);
  return m_new;
}

// Everything one call reads and writes; KV is float, uint16_t (bf16 bits), int8_t or an fp8 byte.
template <typename KV>
struct Problem {
  const float* q;          // [T, Hq, Dh]
  const KV* k;             // [NB, BS, Hkv, Dh], this layer's
  const KV* v;
  const uint16_t* ks;      // [NB, BS, Hkv] float16 bits, this layer's int8 scales; null: none
  const uint16_t* vs;
  const int32_t* tables;   // [S, MB]
  const int32_t* seq;      // [T]
  const int32_t* pos;      // [T]
  const int32_t* vis;      // [T] visible_upto, or null: causal
  const float* sinks;      // [Hq] or null: no sinks
  float* out;              // [T, Hq, Dh]
  int64_t T, Hq, Hkv, G, Dh, NB, BS, S, MB;
  float scale;
  float soft_cap;          // <= 0: none
  int64_t window;          // <= 0: no sliding window

  // Visible positions [lo, hi) of token t.  Defensive for padding and bad input: hi is
  // capped at what a block table row can address, and an empty range gives zeros.
  // kVis (vis non-null): a compile-time choice, so the causal kernel is the code it was.
  template <bool kVis>
  void range(int64_t t, int64_t* lo, int64_t* hi) const {
    const int64_t len = std::min<int64_t>(static_cast<int64_t>(pos[t]) + 1, MB * BS);
    int64_t see = len;
    // A query may see ahead of itself only as far as visible_upto says (its image's end).
    if constexpr (kVis) see = std::min<int64_t>(std::max<int64_t>(pos[t], vis[t]) + 1, MB * BS);
    *hi = std::max<int64_t>(see, 0);
    *lo = window > 0 ? std::max<int64_t>(0, len - window) : 0;
  }
};

// Query rows of a tile (query tokens x the G heads of one KV head) aimed at, whatever G: a
// key tile's K/V rows are read from the cache once and used for all of them (flash-style).
// 48 rows keep the tile's scores, accumulators and scaled queries (~30 KB at head_dim 64) in
// L1/L2 beside the 32 K/V rows.  Which rows share a tile does not change any row's
// arithmetic (see attend_tile), so this is a speed knob only.
constexpr int64_t kRows = 48;

// Scratch of one worker thread, sized for the call's rows per tile (R) and Dh.
template <typename KV>
struct Scratch {
  std::vector<float> qs, acc, s, m, l, corr;   // [R, Dh], [R, Dh], [R, kTile], [R], [R], [R]
  std::vector<float> M, L, ACC;                // [R], [R], [R, Dh]: the spans' state merged so far
  std::vector<float> qp;                       // [ceil(R / 2), Dh / 8, 16]: the AVX-512 path's pack_pairs
  std::vector<int32_t> jlo, jhi;               // [R] each row's visible part of the key tile
  std::vector<const KV*> krow, vrow;           // [kTile] row pointers into the cache
  float ksc[kTile], vsc[kTile];                // the tile's int8 row scales
  void resize(int64_t R, int64_t Dh) {
    qs.resize(R * Dh);
    qp.resize((R + 1) / 2 * 2 * Dh);
    acc.resize(R * Dh);
    s.resize(R * kTile);
    m.resize(R);
    l.resize(R);
    corr.resize(R);
    M.resize(R);
    L.resize(R);
    ACC.resize(R * Dh);
    jlo.resize(R);
    jhi.resize(R);
    krow.resize(kTile);
    vrow.resize(kTile);
  }
};

// The horizontal sum of one row's dot product, by the same shuffle tree as hsum2's: a score
// must not depend on whether its key was paired with a neighbour.
inline float hsum1(__m256 a) {
  float x, y;
  hsum2(a, a, &x, &y);
  return x;
}

// hsum2 of four rows' accumulator pairs at once (a[i]: row i's key j, b[i]: its key j + 1),
// by hsum2's own adds in the same tree, ((l0 + l1) + (l4 + l5)) + ((l2 + l3) + (l6 + l7)),
// so each score is hsum2's bits; 11 vector ops and four 2-float stores for the 8 scores where
// four hsum2 calls and eight scalar stores took ~30, beside the pass's 16 FMAs over a 64-dim head.
// Returns [row 0: j, j + 1; row 2: j, j + 1 | row 1: j, j + 1; row 3: j, j + 1].
inline __m256 hsum2x4(const __m256 a[4], const __m256 b[4]) {
  const __m256 h0 = _mm256_hadd_ps(a[0], b[0]), h1 = _mm256_hadd_ps(a[1], b[1]);
  const __m256 h2 = _mm256_hadd_ps(a[2], b[2]), h3 = _mm256_hadd_ps(a[3], b[3]);
  // hsum2's low half + high half, two rows a register: [row 0 | row 1], [row 2 | row 3]
  const __m256 s01 = _mm256_add_ps(_mm256_permute2f128_ps(h0, h1, 0x20), _mm256_permute2f128_ps(h0, h1, 0x31));
  const __m256 s23 = _mm256_add_ps(_mm256_permute2f128_ps(h2, h3, 0x20), _mm256_permute2f128_ps(h2, h3, 0x31));
  return _mm256_hadd_ps(s01, s23);   // hsum2's last hadd
}

// Scores s[r, j] = q_r . k_j for rows r0 .. r0 + NH and keys j0 <= j < j1, two keys at a time.
// Each score is its own 8-lane accumulation over head_dim in order, then hsum2's tree.
template <int NH, typename KV>
inline void scores(const float* qs, const KV* const* krow, float* s, int64_t j0, int64_t j1, int64_t Dh,
                   int64_t r0) {
  const float* qh = qs + r0 * Dh;
  const int64_t d8 = Dh / 8 * 8;
  int64_t j = j0;
  if constexpr (NH <= 3) {
    // A decode's 1-3 rows: four keys a pass (4 * NH accumulators) where two keys left 2 * NH
    // chains of FMAs waiting on their latency (1.1-1.4x a batch-1 decode's attention at
    // 512-4096 positions, bench/decode_attention.py).  Each score's sum and tree are the two-key pass's.
    for (; j + 4 <= j1; j += 4) {
      __m256 a[4][NH];
      for (int t = 0; t < 4; ++t)
        for (int i = 0; i < NH; ++i) a[t][i] = _mm256_setzero_ps();
      for (int64_t d = 0; d < d8; d += 8) {
        const __m256 k0 = load8(krow[j] + d), k1 = load8(krow[j + 1] + d);
        const __m256 k2 = load8(krow[j + 2] + d), k3 = load8(krow[j + 3] + d);
        for (int i = 0; i < NH; ++i) {
          const __m256 qv = _mm256_loadu_ps(qh + i * Dh + d);
          a[0][i] = _mm256_fmadd_ps(qv, k0, a[0][i]);
          a[1][i] = _mm256_fmadd_ps(qv, k1, a[1][i]);
          a[2][i] = _mm256_fmadd_ps(qv, k2, a[2][i]);
          a[3][i] = _mm256_fmadd_ps(qv, k3, a[3][i]);
        }
      }
      for (int i = 0; i < NH; ++i) {
        float x[4];
        hsum2(a[0][i], a[1][i], &x[0], &x[1]);
        hsum2(a[2][i], a[3][i], &x[2], &x[3]);
        for (int t = 0; t < 4; ++t) {
          for (int64_t d = d8; d < Dh; ++d) x[t] += qh[i * Dh + d] * to_f32(krow[j + t][d]);
          s[(r0 + i) * kTile + j + t] = x[t];
        }
      }
    }
  }
  for (; j + 2 <= j1; j += 2) {
    __m256 a0[NH], a1[NH];
    for (int i = 0; i < NH; ++i) a0[i] = a1[i] = _mm256_setzero_ps();
    for (int64_t d = 0; d < d8; d += 8) {
      const __m256 k0 = load8(krow[j] + d), k1 = load8(krow[j + 1] + d);
      for (int i = 0; i < NH; ++i) {
        const __m256 qv = _mm256_loadu_ps(qh + i * Dh + d);
        a0[i] = _mm256_fmadd_ps(qv, k0, a0[i]);
        a1[i] = _mm256_fmadd_ps(qv, k1, a1[i]);
      }
    }
    if constexpr (NH == 4) {
      if (d8 == Dh) {   // no scalar tail: the four rows' sums in one tree
        const __m256 x = hsum2x4(a0, a1);
        const __m128 lo = _mm256_castps256_ps128(x), hi = _mm256_extractf128_ps(x, 1);
        _mm_storel_pi(reinterpret_cast<__m64*>(s + r0 * kTile + j), lo);
        _mm_storel_pi(reinterpret_cast<__m64*>(s + (r0 + 1) * kTile + j), hi);
        _mm_storeh_pi(reinterpret_cast<__m64*>(s + (r0 + 2) * kTile + j), lo);
        _mm_storeh_pi(reinterpret_cast<__m64*>(s + (r0 + 3) * kTile + j), hi);
        continue;
      }
    }
    for (int i = 0; i < NH; ++i) {
      float x0, x1;
      hsum2(a0[i], a1[i], &x0, &x1);
      for (int64_t d = d8; d < Dh; ++d) {
        x0 += qh[i * Dh + d] * to_f32(krow[j][d]);
        x1 += qh[i * Dh + d] * to_f32(krow[j + 1][d]);
      }
      s[(r0 + i) * kTile + j] = x0;
      s[(r0 + i) * kTile + j + 1] = x1;
    }
  }
  for (; j < j1; ++j) {
    __m256 a[NH];
    for (int i = 0; i < NH; ++i) a[i] = _mm256_setzero_ps();
    for (int64_t d = 0; d < d8; d += 8) {
      const __m256 kv = load8(krow[j] + d);
      for (int i = 0; i < NH; ++i) a[i] = _mm256_fmadd_ps(_mm256_loadu_ps(qh + i * Dh + d), kv, a[i]);
    }
    for (int i = 0; i < NH; ++i) {
      float x = hsum1(a[i]);
      for (int64_t d = d8; d < Dh; ++d) x += qh[i * Dh + d] * to_f32(krow[j][d]);
      s[(r0 + i) * kTile + j] = x;
    }
  }
}

// acc[r, :] = acc[r, :] * corr[r] + sum_j p[r, j] v_j for rows r0 .. r0 + NH and keys
// j0 <= j < j1, where p sits where the scores were (0 outside a row's visible keys); rows
// with corr < 0 see none of this tile's keys and are left alone.  Columns outermost: the sum
// over the tile's keys stays in registers and the accumulators in memory are touched once
// per tile.  A row's sum starts at +0 and adds its keys in order; the zero weights of keys
// it cannot see add exact zeros, so its bits do not depend on the rows beside it.
// Columns from d0 on (the AVX-512 path hands its last columns, fewer than 16, to this one:
// a column's sum is over keys in order whatever the vector width, so the bits agree).
template <int NH, typename KV>
inline void values(const float* p, const KV* const* vrow, float* acc, const float* corr, int64_t j0, int64_t j1,
                   int64_t Dh, int64_t r0, int64_t d0 = 0) {
  const float* ph = p + r0 * kTile;
  float* ah = acc + r0 * Dh;
  int64_t d = d0;
  if constexpr (NH <= 3) {
    // A decode's 1-3 rows: 32 columns a pass, twice the chains of the 16-column pass (as
    // scores' four keys); a column's sum over the keys, in order, is the same.
    for (; d + 32 <= Dh; d += 32) {
      __m256 a[4][NH];
      for (int c = 0; c < 4; ++c)
        for (int i = 0; i < NH; ++i) a[c][i] = _mm256_setzero_ps();
      for (int64_t j = j0; j < j1; ++j) {
        const __m256 v0 = load8(vrow[j] + d), v1 = load8(vrow[j] + d + 8);
        const __m256 v2 = load8(vrow[j] + d + 16), v3 = load8(vrow[j] + d + 24);
        for (int i = 0; i < NH; ++i) {
          const __m256 pj = _mm256_broadcast_ss(ph + i * kTile + j);
          a[0][i] = _mm256_fmadd_ps(pj, v0, a[0][i]);
          a[1][i] = _mm256_fmadd_ps(pj, v1, a[1][i]);
          a[2][i] = _mm256_fmadd_ps(pj, v2, a[2][i]);
          a[3][i] = _mm256_fmadd_ps(pj, v3, a[3][i]);
        }
      }
      for (int i = 0; i < NH; ++i) {
        if (corr[r0 + i] < 0.f) continue;
        const __m256 c = _mm256_set1_ps(corr[r0 + i]);
        float* o = ah + i * Dh + d;
        for (int q = 0; q < 4; ++q)
          _mm256_storeu_ps(o + 8 * q, _mm256_fmadd_ps(_mm256_loadu_ps(o + 8 * q), c, a[q][i]));
      }
    }
  }
  for (; d + 16 <= Dh; d += 16) {
    __m256 a0[NH], a1[NH];
    for (int i = 0; i < NH; ++i) a0[i] = a1[i] = _mm256_setzero_ps();
    for (int64_t j = j0; j < j1; ++j) {
      const __m256 v0 = load8(vrow[j] + d), v1 = load8(vrow[j] + d + 8);
      for (int i = 0; i < NH; ++i) {
        const __m256 pj = _mm256_broadcast_ss(ph + i * kTile + j);
        a0[i] = _mm256_fmadd_ps(pj, v0, a0[i]);
        a1[i] = _mm256_fmadd_ps(pj, v1, a1[i]);
      }
    }
    for (int i = 0; i < NH; ++i) {
      if (corr[r0 + i] < 0.f) continue;
      const __m256 c = _mm256_set1_ps(corr[r0 + i]);
      float* o = ah + i * Dh + d;
      _mm256_storeu_ps(o, _mm256_fmadd_ps(_mm256_loadu_ps(o), c, a0[i]));
      _mm256_storeu_ps(o + 8, _mm256_fmadd_ps(_mm256_loadu_ps(o + 8), c, a1[i]));
    }
  }
  for (; d + 8 <= Dh; d += 8) {
    __m256 a[NH];
    for (int i = 0; i < NH; ++i) a[i] = _mm256_setzero_ps();
    for (int64_t j = j0; j < j1; ++j) {
      const __m256 vv = load8(vrow[j] + d);
      for (int i = 0; i < NH; ++i) a[i] = _mm256_fmadd_ps(_mm256_broadcast_ss(ph + i * kTile + j), vv, a[i]);
    }
    for (int i = 0; i < NH; ++i) {
      if (corr[r0 + i] < 0.f) continue;
      float* o = ah + i * Dh + d;
      _mm256_storeu_ps(o, _mm256_fmadd_ps(_mm256_loadu_ps(o), _mm256_set1_ps(corr[r0 + i]), a[i]));
    }
  }
  for (; d < Dh; ++d) {   // head dims that are not a multiple of 8
    for (int i = 0; i < NH; ++i) {
      if (corr[r0 + i] < 0.f) continue;
      float x = 0.f;
      for (int64_t j = j0; j < j1; ++j) x += ph[i * kTile + j] * to_f32(vrow[j][d]);
      ah[i * Dh + d] = ah[i * Dh + d] * corr[r0 + i] + x;
    }
  }
}

// All R rows in passes of at most kHeads.
template <typename KV>
void scores_all(const float* qs, const KV* const* krow, float* s, int64_t j0, int64_t j1, int64_t Dh, int64_t R) {
  int64_t r = 0;
  for (; r + kHeads <= R; r += kHeads) scores<kHeads>(qs, krow, s, j0, j1, Dh, r);
  switch (R - r) {
    case 3: scores<3>(qs, krow, s, j0, j1, Dh, r); break;
    case 2: scores<2>(qs, krow, s, j0, j1, Dh, r); break;
    case 1: scores<1>(qs, krow, s, j0, j1, Dh, r); break;
    default: break;
  }
}

template <typename KV>
void values_all(const float* p, const KV* const* vrow, float* acc, const float* corr, int64_t j0, int64_t j1,
                int64_t Dh, int64_t R) {
  int64_t r = 0;
  for (; r + kHeads <= R; r += kHeads) values<kHeads>(p, vrow, acc, corr, j0, j1, Dh, r);
  switch (R - r) {
    case 3: values<3>(p, vrow, acc, corr, j0, j1, Dh, r); break;
    case 2: values<2>(p, vrow, acc, corr, j0, j1, Dh, r); break;
    case 1: values<1>(p, vrow, acc, corr, j0, j1, Dh, r); break;
    default: break;
  }
}

// ------------------------------------------------------------------ AVX-512 (16-lane) path
// Used where the CPU has AVX512F/BW (g_avx512; jaxllm_attention_set_avx512 overrides it so
// that the tests run both paths on one machine).  Decode (a tile of one) and prefill run the
// same functions, so a token's bits still do not depend on its tile; and each path does the
// AVX2 path's arithmetic lane for lane (scores: two keys' 8-lane sums per register; P.V: a
// column's sum over keys in order), so the bits do not depend on the CPU either.
#define JAXLLM_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma")))

bool detect_avx512() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");
}
const bool kHasAvx512 = detect_avx512();
bool g_avx512 = kHasAvx512;

// Query rows per pass: 4 row pairs x 4 keys (scores) or 8 rows x 2 column vectors (values)
// of accumulators, plus operands, fit in the 32 AVX-512 registers.
constexpr int kPairs512 = 4;
constexpr int kHeads512 = 8;

// 16 values at p as float32, one load per format.
JAXLLM_AVX512 inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
JAXLLM_AVX512 inline __m512 load16(const uint16_t* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
JAXLLM_AVX512 inline __m512 load16(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
JAXLLM_AVX512 inline __m512 load16_table(const uint8_t* p, const float* table) {
  return _mm512_i32gather_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), table, 4);
}
JAXLLM_AVX512 inline __m512 load16(const Fp8E4M3* p) { return load16_table(&p->bits, kE4M3.v); }
JAXLLM_AVX512 inline __m512 load16(const Fp8E5M2* p) { return load16_table(&p->bits, kE5M2.v); }

// 8 values of a key (any format) as float32 in both 8-lane halves.
template <typename KV>
JAXLLM_AVX512 inline __m512 bcast8(const KV* p) {
  return _mm512_castpd_ps(_mm512_broadcast_f64x4(_mm256_castps_pd(load8(p))));
}
JAXLLM_AVX512 inline __m256 lo8(__m512 a) { return _mm512_castps512_ps256(a); }
JAXLLM_AVX512 inline __m256 hi8(__m512 a) {
  return _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1));
}

// exp8's operations on 16 lanes, lane for lane (the same bits for the same input).
JAXLLM_AVX512 inline __m512 exp16(__m512 x) {
  x = _mm512_min_ps(x, _mm512_set1_ps(88.3762626647949f));
  x = _mm512_max_ps(x, _mm512_set1_ps(-88.3762626647949f));
  __m512 fx = _mm512_roundscale_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f)),
                                   _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(0.693359375f), x);
  x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(-2.12194440e-4f), x);
  __m512 y = _mm512_set1_ps(1.9875691500e-4f);
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.3981999507e-3f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(8.3334519073e-3f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(4.1665795894e-2f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.6666665459e-1f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(5.0000001201e-1f));
  y = _mm512_fmadd_ps(y, _mm512_mul_ps(x, x), x);
  y = _mm512_add_ps(y, _mm512_set1_ps(1.0f));
  __m512i n = _mm512_add_epi32(_mm512_cvttps_epi32(fx), _mm512_set1_epi32(127));
  return _mm512_mul_ps(y, _mm512_castsi512_ps(_mm512_slli_epi32(n, 23)));
}

// exp_row on 16 lanes: the same maximum (max is exact in any order), the same exps, and the
// same sum: exp_row's 8-lane lane i is ((e_i + e_i+8) + e_i+16) + e_i+24 (its 0 + e_i is
// e_i: e >= +0), here the halves of the two 16-key vectors added in that order, then hsum.
JAXLLM_AVX512 __attribute__((noinline)) float exp_row512(float* s, float m_old, float* sum) {
  const __m512 s0 = _mm512_loadu_ps(s), s1 = _mm512_loadu_ps(s + 16);
  const float m_new = std::max(m_old, _mm512_reduce_max_ps(_mm512_max_ps(s0, s1)));
  const __m512 mv = _mm512_set1_ps(m_new);
  const __m512 e0 = exp16(_mm512_sub_ps(s0, mv)), e1 = exp16(_mm512_sub_ps(s1, mv));
  _mm512_storeu_ps(s, e0);
  _mm512_storeu_ps(s + 16, e1);
  __m256 acc = _mm256_add_ps(lo8(e0), hi8(e0));
  acc = _mm256_add_ps(acc, lo8(e1));
  acc = _mm256_add_ps(acc, hi8(e1));
  *sum = hsum(acc);
  return m_new;
}

// The scaled queries two rows to a register: qp [ceil(R / 2), Dh / 8, 16], pair p's chunk c
// holding row 2p's dims 8c .. 8c + 7 in lanes 0-7 and row 2p + 1's in lanes 8-15 (zeros for
// a missing last row).  Written once per work item; read by every key tile.
JAXLLM_AVX512 void pack_pairs(const float* qs, float* qp, int64_t R, int64_t Dh) {
  const int64_t C = Dh / 8;
  for (int64_t p = 0; p < (R + 1) / 2; ++p)
    for (int64_t c = 0; c < C; ++c) {
      const __m256 a = _mm256_loadu_ps(qs + 2 * p * Dh + 8 * c);
      const __m256 b = 2 * p + 1 < R ? _mm256_loadu_ps(qs + (2 * p + 1) * Dh + 8 * c) : _mm256_setzero_ps();
      _mm256_storeu_ps(qp + (p * C + c) * 16, a);
      _mm256_storeu_ps(qp + (p * C + c) * 16 + 8, b);
    }
}

// hsum2 of four keys' accumulators at once (each: row r's 8 partial sums in lanes 0-7, row
// r + 1's in 8-15): the same tree for every score, ((l0 + l1) + (l4 + l5)) + ((l2 + l3) +
// (l6 + l7)), as hsum2 takes it (its adds are the same adds, and a + b is b + a bit for bit),
// in 11 vector ops for the 8 scores where 4 hsum2 calls took ~40 (a prefill's scores spent
// more time in the sums than in the dot products).  Returns [row r: keys 0..3 | row r + 1: keys 0..3].
JAXLLM_AVX512 inline __m256 reduce4x2(__m512 a0, __m512 a1, __m512 a2, __m512 a3) {
  // per 128-bit lane: [x0 + x1, x2 + x3, y0 + y1, y2 + y3]; lanes: r dims 0-3, r dims 4-7,
  // r + 1 dims 0-3, r + 1 dims 4-7
  const __m512 u01 = _mm512_add_ps(_mm512_shuffle_ps(a0, a1, _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm512_shuffle_ps(a0, a1, _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512 u23 = _mm512_add_ps(_mm512_shuffle_ps(a2, a3, _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm512_shuffle_ps(a2, a3, _MM_SHUFFLE(3, 1, 3, 1)));
  // dims 0-3 + dims 4-7: lanes [keys 0, 1 of r | of r + 1 | keys 2, 3 of r | of r + 1], each
  // key as (l01 + l45, l23 + l67)
  const __m512 x = _mm512_add_ps(_mm512_shuffle_f32x4(u01, u23, _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm512_shuffle_f32x4(u01, u23, _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512 y = _mm512_add_ps(x, _mm512_permute_ps(x, _MM_SHUFFLE(2, 3, 0, 1)));   // the last add
  const __m512i pick = _mm512_setr_epi32(0, 2, 8, 10, 4, 6, 12, 14, 0, 0, 0, 0, 0, 0, 0, 0);
  return _mm512_castps512_ps256(_mm512_permutexvar_ps(pick, y));
}

// scores() on 16 lanes with scores()'s exact arithmetic: a register holds two rows' 8 partial
// sums over head_dim for one key, in the same order as scores()'s 8-lane accumulator, and
// hsum2 takes the two halves as scores() takes its two keys, so every score is scores()'s
// bits.  (Summing 16 dims per lane instead was as fast but changed the scores' last bits, and
// int8 activations, --cpu-matmul native-int8, turn a last-bit change in attention into logit
// moves of 0.1-0.4 nats: which CPU runs the model must not change what it says.)  Row pairs
// p0 .. p0 + NP, keys j .. j + K: NP x K accumulators, each key's 8 dims broadcast once for
// NP pairs.  Head dims must be a multiple of 8 (scores_all512 sends the others to scores()).
template <int NP, int K, typename KV>
JAXLLM_AVX512 inline void scores512(const float* qp, const KV* const* krow, float* s, int64_t j, int64_t Dh,
                                    int64_t p0, int64_t R) {
  const int64_t C = Dh / 8;
  __m512 a[NP][K];
  for (int p = 0; p < NP; ++p)
    for (int k = 0; k < K; ++k) a[p][k] = _mm512_setzero_ps();
  for (int64_t c = 0; c < C; ++c) {
    __m512 kb[K];
    for (int k = 0; k < K; ++k) kb[k] = bcast8(krow[j + k] + 8 * c);
    for (int p = 0; p < NP; ++p) {
      const __m512 qv = _mm512_loadu_ps(qp + ((p0 + p) * C + c) * 16);
      for (int k = 0; k < K; ++k) a[p][k] = _mm512_fmadd_ps(qv, kb[k], a[p][k]);
    }
  }
  if constexpr (K == 4) {
    for (int p = 0; p < NP; ++p) {
      const int64_t r = 2 * (p0 + p);
      const __m256 both = reduce4x2(a[p][0], a[p][1], a[p][2], a[p][3]);   // row r's 4 scores, then row r + 1's
      _mm_storeu_ps(s + r * kTile + j, _mm256_castps256_ps128(both));
      if (r + 1 < R) _mm_storeu_ps(s + (r + 1) * kTile + j, _mm256_extractf128_ps(both, 1));
    }
    return;
  }
  for (int p = 0; p < NP; ++p) {
    const int64_t r = 2 * (p0 + p);
    for (int k = 0; k < K; ++k) {
      float x, y;
      hsum2(lo8(a[p][k]), hi8(a[p][k]), &x, &y);
      s[r * kTile + j + k] = x;
      if (r + 1 < R) s[(r + 1) * kTile + j + k] = y;
    }
  }
}

// Keys j .. j + K for all row pairs, NP at a time.
template <int K, typename KV>
JAXLLM_AVX512 inline void scores512_keys(const float* qp, const KV* const* krow, float* s, int64_t j, int64_t Dh,
                                         int64_t R) {
  const int64_t P = (R + 1) / 2;
  int64_t p = 0;
  for (; p + kPairs512 <= P; p += kPairs512) scores512<kPairs512, K, KV>(qp, krow, s, j, Dh, p, R);
  switch (P - p) {
    case 3: scores512<3, K, KV>(qp, krow, s, j, Dh, p, R); break;
    case 2: scores512<2, K, KV>(qp, krow, s, j, Dh, p, R); break;
    case 1: scores512<1, K, KV>(qp, krow, s, j, Dh, p, R); break;
    default: break;
  }
}

// values() 32 then 16 columns at a time; the last Dh % 16 columns go to values().
template <int NH, typename KV>
JAXLLM_AVX512 inline void values512(const float* p, const KV* const* vrow, float* acc, const float* corr, int64_t j0,
                                    int64_t j1, int64_t Dh, int64_t r0) {
  const float* ph = p + r0 * kTile;
  float* ah = acc + r0 * Dh;
  int64_t d = 0;
  for (; d + 32 <= Dh; d += 32) {
    __m512 a0[NH], a1[NH];
    for (int i = 0; i < NH; ++i) a0[i] = a1[i] = _mm512_setzero_ps();
    for (int64_t j = j0; j < j1; ++j) {
      const __m512 v0 = load16(vrow[j] + d), v1 = load16(vrow[j] + d + 16);
      for (int i = 0; i < NH; ++i) {
        const __m512 pj = _mm512_set1_ps(ph[i * kTile + j]);
        a0[i] = _mm512_fmadd_ps(pj, v0, a0[i]);
        a1[i] = _mm512_fmadd_ps(pj, v1, a1[i]);
      }
    }
    for (int i = 0; i < NH; ++i) {
      if (corr[r0 + i] < 0.f) continue;
      const __m512 c = _mm512_set1_ps(corr[r0 + i]);
      float* o = ah + i * Dh + d;
      _mm512_storeu_ps(o, _mm512_fmadd_ps(_mm512_loadu_ps(o), c, a0[i]));
      _mm512_storeu_ps(o + 16, _mm512_fmadd_ps(_mm512_loadu_ps(o + 16), c, a1[i]));
    }
  }
  for (; d + 16 <= Dh; d += 16) {
    __m512 a[NH];
    for (int i = 0; i < NH; ++i) a[i] = _mm512_setzero_ps();
    for (int64_t j = j0; j < j1; ++j) {
      const __m512 vv = load16(vrow[j] + d);
      for (int i = 0; i < NH; ++i) a[i] = _mm512_fmadd_ps(_mm512_set1_ps(ph[i * kTile + j]), vv, a[i]);
    }
    for (int i = 0; i < NH; ++i) {
      if (corr[r0 + i] < 0.f) continue;
      float* o = ah + i * Dh + d;
      _mm512_storeu_ps(o, _mm512_fmadd_ps(_mm512_loadu_ps(o), _mm512_set1_ps(corr[r0 + i]), a[i]));
    }
  }
  if (d < Dh) values<NH, KV>(p, vrow, acc, corr, j0, j1, Dh, r0, d);
}

// s [R, kTile] for keys j0 <= j < j1: scores() on 16 lanes, four keys at a time (qp: pack_pairs').
template <typename KV>
JAXLLM_AVX512 void scores_all512(const float* qs, const float* qp, const KV* const* krow, float* s, int64_t j0,
                                 int64_t j1, int64_t Dh, int64_t R) {
  if (Dh % 8) return scores_all<KV>(qs, krow, s, j0, j1, Dh, R);
  int64_t j = j0;
  for (; j + 4 <= j1; j += 4) scores512_keys<4, KV>(qp, krow, s, j, Dh, R);
  for (; j < j1; ++j) scores512_keys<1, KV>(qp, krow, s, j, Dh, R);
}

template <typename KV>
JAXLLM_AVX512 void values_all512(const float* p, const KV* const* vrow, float* acc, const float* corr, int64_t j0,
                                 int64_t j1, int64_t Dh, int64_t R) {
  int64_t r = 0;
  for (; r + kHeads512 <= R; r += kHeads512) values512<kHeads512>(p, vrow, acc, corr, j0, j1, Dh, r);
  switch (R - r) {
    case 7: values512<7>(p, vrow, acc, corr, j0, j1, Dh, r); break;
    case 6: values512<6>(p, vrow, acc, corr, j0, j1, Dh, r); break;
    case 5: values512<5>(p, vrow, acc, corr, j0, j1, Dh, r); break;
    case 4: values512<4>(p, vrow, acc, corr, j0, j1, Dh, r); break;
    case 3: values512<3>(p, vrow, acc, corr, j0, j1, Dh, r); break;
    case 2: values512<2>(p, vrow, acc, corr, j0, j1, Dh, r); break;
    case 1: values512<1>(p, vrow, acc, corr, j0, j1, Dh, r); break;
    default: break;
  }
}

// Keys are walked in spans of kSpan positions at absolute offsets [s * kSpan, (s + 1) * kSpan):
// each span's softmax state (running max m, sum l, accumulators acc per row) starts afresh
// and is merged into the row's totals span by span, in order (merge_span).  A decode of one
// sequence is 3 items on the built-in model (one per KV head), which two cores split 2 + 1;
// as (KV head, span) items its spans' states are computed side by side and merged after, in
// the same order by the same function, so the bits are those of the walk in one item (a
// prefill's).  A row whose keys lie in one span has the bits it had before spans: the first
// merge copies the state exactly (M = -inf: a = 0; b = exp(0) = 1).
constexpr int64_t kSpan = 8 * kTile;

// Folds one span's state (m, l [R], acc [R, Dh]) into the totals (M, L, ACC): both sides
// rescaled to the larger maximum.  Explicit fused multiply-adds, vector and scalar alike, so
// that every caller computes the same bits.
inline void merge_span(int64_t R, int64_t Dh, const float* m, const float* l, const float* acc, float* M, float* L,
                       float* ACC) {
  for (int64_t r = 0; r < R; ++r) {
    if (m[r] == -INFINITY) continue;   // no key of this span is visible to the row
    const float top = std::max(M[r], m[r]);
    const float a = std::exp(M[r] - top), b = std::exp(m[r] - top);
    L[r] = std::fma(L[r], a, l[r] * b);
    M[r] = top;
    const __m256 av = _mm256_set1_ps(a), bv = _mm256_set1_ps(b);
    float* T = ACC + r * Dh;
    const float* x = acc + r * Dh;
    int64_t d = 0;
    for (; d + 8 <= Dh; d += 8)
      _mm256_storeu_ps(T + d, _mm256_fmadd_ps(_mm256_loadu_ps(T + d), av, _mm256_mul_ps(_mm256_loadu_ps(x + d), bv)));
    for (; d < Dh; ++d) T[d] = std::fma(T[d], a, x[d] * b);
  }
}

// The first and last span holding a position of [lo_all, hi_all) (first > last: empty).
inline void span_range(int64_t lo_all, int64_t hi_all, int64_t* first, int64_t* last) {
  *first = lo_all < hi_all ? lo_all / kSpan : 1;
  *last = lo_all < hi_all ? (hi_all - 1) / kSpan : 0;
}

// The first and last span holding a key visible to some token of the tile.
template <typename KV, bool kVis>
void tile_spans(const Problem<KV>& P, int64_t t0, int64_t nt, int64_t* first, int64_t* last) {
  int64_t lo_all = INT64_MAX, hi_all = 0;
  for (int64_t i = 0; i < nt; ++i) {
    int64_t lo, hi;
    P.template range<kVis>(t0 + i, &lo, &hi);
    if (lo < hi) lo_all = std::min(lo_all, lo), hi_all = std::max(hi_all, hi);
  }
  span_range(lo_all, hi_all, first, last);
}

// out[t, h*G : (h+1)*G, :] of the tile's tokens from their rows' totals: ACC / L (the sinks'
// exp joins L); zeros for a token that sees no key.
template <typename KV, bool kVis>
void write_out(const Problem<KV>& P, int64_t t0, int64_t nt, int64_t h, const float* M, const float* L,
               const float* ACC) {
  const int64_t G = P.G, Dh = P.Dh;
  for (int64_t i = 0; i < nt; ++i) {
    float* out = P.out + ((t0 + i) * P.Hq + h * G) * Dh;   // [G, Dh], the group's heads are adjacent
    int64_t lo, hi;
    P.template range<kVis>(t0 + i, &lo, &hi);
    if (lo >= hi) {
      std::fill(out, out + G * Dh, 0.f);
      continue;
    }
    for (int64_t g = 0; g < G; ++g) {
      const int64_t r = i * G + g;
      float inv = 1.f / L[r];   // L >= 1: the maximum's own term is exp(0)
      if (P.sinks) {
        // The sink's exp joins the denominator: acc / (l + exp(sink - m)), both exponentials
        // taken against the larger of m and the sink.
        const float sink = P.sinks[h * G + g], top = std::max(M[r], sink), c = std::exp(M[r] - top);
        inv = c / (L[r] * c + std::exp(sink - top));
      }
      for (int64_t d = 0; d < Dh; ++d) out[g * Dh + d] = ACC[r * Dh + d] * inv;
    }
  }
}

// Work item (tokens t0 .. t0 + nt of one sequence, KV head h): out[t, h*G : (h+1)*G, :] for
// each of the tokens.  Row r = i * G + g is token t0 + i's query head h * G + g.
//
// Bit-stability: a token's output must be the same bits whether it runs alone (a decode,
// nt = 1) or in any tile of a prefill chunk.  So key tiles sit at absolute positions
// [c * kTile, (c + 1) * kTile) for every row, a row takes part in exactly the tiles that hold
// a position it may see, and within a tile its scores, maxima, exponentials, sums and value
// accumulation are computed lane for lane as they would be alone, with the positions it
// may not see as -inf scores / zero weights.
//
// only_span >= 0: that span alone, its state written to partial ([m [R], l [R], acc [R, Dh]])
// for finish_spans to merge, and no output.  Not inlined: the split and the whole walks
// (decode and prefill) then run one compiled body, whose floating-point contractions are
// the compiler's choice once, not once per call site.
template <typename KV, bool kVis>
__attribute__((noinline)) void attend_tile(const Problem<KV>& P, int64_t t0, int64_t nt, int64_t h, Scratch<KV>& w,
                                           int64_t only_span = -1, float* partial = nullptr) {
  const int64_t G = P.G, Dh = P.Dh, R = nt * G;
  // Each token's visible range, and the union over the tile.
  int64_t lo_all = INT64_MAX, hi_all = 0;
  int64_t lo_t[kRows], hi_t[kRows];   // nt <= kRows
  for (int64_t i = 0; i < nt; ++i) {
    P.template range<kVis>(t0 + i, &lo_t[i], &hi_t[i]);
    if (lo_t[i] < hi_t[i]) {
      lo_all = std::min(lo_all, lo_t[i]);
      hi_all = std::max(hi_all, hi_t[i]);
    }
  }
  // Queries scaled before the dot, as the XLA path does (q * scale, then q . k).
  for (int64_t i = 0; i < nt; ++i) {
    const float* q = P.q + ((t0 + i) * P.Hq + h * G) * Dh;
    float* qs = w.qs.data() + i * G * Dh;
    for (int64_t e = 0; e < G * Dh; ++e) qs[e] = q[e] * P.scale;
  }
  if (g_avx512 && Dh % 8 == 0) pack_pairs(w.qs.data(), w.qp.data(), R, Dh);
  std::fill(w.ACC.begin(), w.ACC.begin() + R * Dh, 0.f);
  std::fill(w.M.begin(), w.M.begin() + R, -INFINITY);
  std::fill(w.L.begin(), w.L.begin() + R, 0.f);
  // Clamped so that a padding token (or a bad index) reads some row of the cache instead
  // of outside it; its output is not used.
  const int64_t seq = std::clamp<int64_t>(P.seq[t0], 0, P.S - 1);
  const int32_t* table = P.tables + seq * P.MB;
  const KV** krow = w.krow.data();
  const KV** vrow = w.vrow.data();
  float* corr = w.corr.data();
  int64_t s_first = only_span, s_last = only_span;
  if (only_span < 0) span_range(lo_all, hi_all, &s_first, &s_last);
  for (int64_t span = s_first; span <= s_last; ++span) {
    std::fill(w.acc.begin(), w.acc.begin() + R * Dh, 0.f);
    std::fill(w.m.begin(), w.m.begin() + R, -INFINITY);
    std::fill(w.l.begin(), w.l.begin() + R, 0.f);
    const int64_t c_end = std::min(hi_all, (span + 1) * kSpan);
    for (int64_t c0 = std::max(span * kSpan, lo_all / kTile * kTile); c0 < c_end; c0 += kTile) {
      // Each row's visible keys [jlo, jhi) of this tile, and their union [j0, j1).
      int64_t j0 = kTile, j1 = 0;
      for (int64_t i = 0; i < nt; ++i) {
        const int64_t a = std::clamp<int64_t>(lo_t[i] - c0, 0, kTile);
        const int64_t b = std::clamp<int64_t>(hi_t[i] - c0, 0, kTile);
        for (int64_t g = 0; g < G; ++g)
          w.jlo[i * G + g] = static_cast<int32_t>(a), w.jhi[i * G + g] = static_cast<int32_t>(b);
        if (a < b) j0 = std::min(j0, a), j1 = std::max(j1, b);
      }
      if (j0 >= j1) continue;
      // Block column and offset stepped along: one integer division per tile, not per position.
      int64_t col = (c0 + j0) / P.BS, off = (c0 + j0) % P.BS;
      int64_t blk = std::clamp<int64_t>(table[col], 0, P.NB - 1);
      for (int64_t j = j0; j < j1; ++j, ++off) {
        if (off == P.BS) {
          off = 0;
          blk = std::clamp<int64_t>(table[++col], 0, P.NB - 1);
        }
        const int64_t row = (blk * P.BS + off) * P.Hkv + h;
        krow[j] = P.k + row * Dh;
        vrow[j] = P.v + row * Dh;
        if (P.ks) {
          w.ksc[j] = half_to_f32(P.ks[row]);
          w.vsc[j] = half_to_f32(P.vs[row]);
        }
      }
      // The rows are scattered over blocks and cold (a layer's cache was last read a whole
      // step ago): ask for all of the tile's lines at once rather than one miss at a time
      // (15-20% off a cold-cache batch-32 decode; prefetching a tile ahead gained nothing).
      for (int64_t j = j0; j < j1; ++j)
        for (int64_t b = 0; b < Dh * static_cast<int64_t>(sizeof(KV)); b += 64) {
          _mm_prefetch(reinterpret_cast<const char*>(krow[j]) + b, _MM_HINT_T0);
          _mm_prefetch(reinterpret_cast<const char*>(vrow[j]) + b, _MM_HINT_T0);
        }
      if (g_avx512)
        scores_all512<KV>(w.qs.data(), w.qp.data(), krow, w.s.data(), j0, j1, Dh, R);   // s [R, kTile]
      else
        scores_all<KV>(w.qs.data(), krow, w.s.data(), j0, j1, Dh, R);
      for (int64_t r = 0; r < R; ++r) {
        float* s = w.s.data() + r * kTile;
        const int64_t a = w.jlo[r], b = w.jhi[r];
        if (a >= b) {   // no visible key here: zero weights, accumulators untouched
          std::fill(s, s + kTile, 0.f);
          corr[r] = -1.f;
          continue;
        }
        if (P.ks)   // int8: q . (scale_j k_j) = scale_j (q . k_j)
          for (int64_t j = a; j < b; ++j) s[j] *= w.ksc[j];
        if (P.soft_cap > 0.f) {   // Gemma 2: cap * tanh(s / cap) on the scaled scores
          const float cap = P.soft_cap, inv_cap = 1.f / P.soft_cap;
          for (int64_t j = a; j < b; ++j) s[j] = cap * std::tanh(s[j] * inv_cap);
        }
        // Online softmax: new running max per row, scores -> exp(s - max) in place (keys the
        // row may not see set to -inf give 0), accumulators rescaled by exp(old max - new max).
        std::fill(s, s + a, -INFINITY);
        std::fill(s + b, s + kTile, -INFINITY);
        float sum;
        const float m_new = g_avx512 ? exp_row512(s, w.m[r], &sum) : exp_row(s, w.m[r], &sum);
        corr[r] = std::exp(w.m[r] - m_new);   // 0 on the row's first tile (m = -inf)
        w.l[r] = w.l[r] * corr[r] + sum;
        w.m[r] = m_new;
        if (P.vs)   // int8: p_j (scale_j v_j) = (p_j scale_j) v_j; the sum l keeps p_j
          for (int64_t j = a; j < b; ++j) s[j] *= w.vsc[j];
      }
      if (g_avx512)
        values_all512<KV>(w.s.data(), vrow, w.acc.data(), corr, j0, j1, Dh, R);
      else
        values_all<KV>(w.s.data(), vrow, w.acc.data(), corr, j0, j1, Dh, R);
    }
    if (partial) {
      std::copy(w.m.begin(), w.m.begin() + R, partial);
      std::copy(w.l.begin(), w.l.begin() + R, partial + R);
      std::copy(w.acc.begin(), w.acc.begin() + R * Dh, partial + 2 * R);
      return;
    }
    merge_span(R, Dh, w.m.data(), w.l.data(), w.acc.data(), w.M.data(), w.L.data(), w.ACC.data());
  }
  write_out<KV, kVis>(P, t0, nt, h, w.M.data(), w.L.data(), w.ACC.data());
}

// The tile's spans' states (partials: one [R * (Dh + 2)] block per span, in order) merged
// as attend_tile merges them, and its output written.
template <typename KV, bool kVis>
void finish_spans(const Problem<KV>& P, int64_t t0, int64_t nt, int64_t h, const float* partials, int64_t spans,
                  Scratch<KV>& w) {
  const int64_t R = nt * P.G, Dh = P.Dh;
  std::fill(w.ACC.begin(), w.ACC.begin() + R * Dh, 0.f);
  std::fill(w.M.begin(), w.M.begin() + R, -INFINITY);
  std::fill(w.L.begin(), w.L.begin() + R, 0.f);
  for (int64_t s = 0; s < spans; ++s) {
    const float* p = partials + s * R * (Dh + 2);
    merge_span(R, Dh, p, p + R, p + 2 * R, w.M.data(), w.L.data(), w.ACC.data());
  }
  write_out<KV, kVis>(P, t0, nt, h, w.M.data(), w.L.data(), w.ACC.data());
}

template <typename KV, bool kVis>
void paged_attention(ffi::ThreadPool& pool, const Problem<KV>& P) {
  if (P.T * P.Hkv == 0) return;
  // Helpers only when the call is worth waking them: a task costs microseconds to start,
  // a decode of a short context is less than that.
  int64_t cost = 0;   // multiply-adds of q . k over the batch
  for (int64_t t = 0; t < P.T; ++t) {
    int64_t lo, hi;
    P.template range<kVis>(t, &lo, &hi);
    cost += std::max<int64_t>(hi - lo, 0) * P.Hq * P.Dh;
  }
  // Query tiles: runs of consecutive tokens of one sequence at consecutive positions (a
  // prefill chunk), cut every Tq tokens; a decode token is a tile of its own.
  const int64_t Tq = std::max<int64_t>(1, kRows / P.G);
  auto tiles = std::make_shared<std::vector<std::pair<int32_t, int32_t>>>();   // (first token, count)
  for (int64_t t = 0; t < P.T;) {
    int64_t n = 1;
    while (t + n < P.T && n < Tq && P.seq[t + n] == P.seq[t] && P.pos[t + n] == P.pos[t + n - 1] + 1) ++n;
    tiles->emplace_back(static_cast<int32_t>(t), static_cast<int32_t>(n));
    t += n;
  }
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  int64_t max_nt = 1;
  for (const auto& tile : *tiles) max_nt = std::max<int64_t>(max_nt, tile.second);
  // Scratch for the call's largest tile (a decode's rows are G, not kRows: less to clear).
  const auto make_scratch = [R = max_nt * P.G, Dh = P.Dh] {
    Scratch<KV> w;
    w.resize(R, Dh);
    return w;
  };
  // Where the (tile, KV head) items are too few to keep the cores busy (a decode of one or
  // two sequences), a tile whose keys cross spans is split into one item per span.
  std::vector<std::pair<int64_t, int64_t>> spans;   // each tile's first and last span
  bool split_any = false;
  if (static_cast<int64_t>(tiles->size()) * P.Hkv < 4 * threads) {
    for (const auto& [t0, nt] : *tiles) {
      int64_t first, last;
      tile_spans<KV, kVis>(P, t0, nt, &first, &last);
      spans.emplace_back(first, last);
      split_any |= last > first;
    }
  }
  if (!split_any) {
    // Items are (tile, KV head), tile-major: a tile's heads, and a sequence's tiles, are
    // claimed close together and share cache rows.  P and the tiles are held by the task: a
    // helper task may start after this call has returned (and then finds no item).
    const int64_t items = static_cast<int64_t>(tiles->size()) * P.Hkv;
    jaxllm_parallel::for_each_item(
        pool, items, std::min({threads, items - 1, cost / 32768}), make_scratch,
        [P, tiles](int64_t i, Scratch<KV>& w) {
          const auto [t0, nt] = (*tiles)[i / P.Hkv];
          attend_tile<KV, kVis>(P, t0, nt, i % P.Hkv, w);
        });
    return;
  }
  // One item per (tile, KV head, span), each span's state into `partials`, merged after.
  struct Item {
    int32_t tile, h, span;   // span -1: the whole walk, output written (a tile of one span)
    int64_t offset;          // its state's place in partials
  };
  struct Split {
    std::vector<Item> items;
    std::vector<float> partials;
  };
  auto split = std::make_shared<Split>();
  int64_t size = 0;
  for (int32_t ti = 0; ti < static_cast<int32_t>(tiles->size()); ++ti) {
    const auto [first, last] = spans[ti];
    const int64_t nt = (*tiles)[ti].second;
    for (int32_t h = 0; h < P.Hkv; ++h) {
      if (last <= first) {
        split->items.push_back({ti, h, -1, 0});
        continue;
      }
      for (int64_t s = first; s <= last; ++s) {
        split->items.push_back({ti, h, static_cast<int32_t>(s), size});
        size += nt * P.G * (P.Dh + 2);
      }
    }
  }
  split->partials.resize(size);
  const int64_t items = static_cast<int64_t>(split->items.size());
  jaxllm_parallel::for_each_item(
      pool, items, std::min({threads, items - 1, cost / 32768}), make_scratch,
      [P, tiles, split](int64_t i, Scratch<KV>& w) {
        const Item& it = split->items[i];
        const auto [t0, nt] = (*tiles)[it.tile];
        if (it.span < 0)
          attend_tile<KV, kVis>(P, t0, nt, it.h, w);
        else
          attend_tile<KV, kVis>(P, t0, nt, it.h, w, it.span, split->partials.data() + it.offset);
      });
  Scratch<KV> w = make_scratch();
  for (int64_t i = 0; i < items;) {   // each split (tile, head): its spans are consecutive items
    const Item& it = split->items[i];
    int64_t n = 1;
    while (it.span >= 0 && i + n < items && split->items[i + n].tile == it.tile && split->items[i + n].h == it.h) ++n;
    if (it.span >= 0) {
      const auto [t0, nt] = (*tiles)[it.tile];
      finish_spans<KV, kVis>(P, t0, nt, it.h, split->partials.data() + it.offset, n, w);
    }
    i += n;
  }
}

ffi::Error invalid(const std::string& what) {
  return ffi::Error::InvalidArgument("jaxllm_paged_attention: " + what);
}

std::string dims_str(ffi::Span<const int64_t> d) {
  std::string s = "[";
  for (size_t i = 0; i < d.size(); ++i) s += (i ? ", " : "") + std::to_string(d[i]);
  return s + "]";
}

// Checks the shapes and runs the kernel over a cache of KV elements (k/v: the whole
// buffers, ks/vs: their int8 scales or null).
template <typename KV>
ffi::Error Run(ffi::ThreadPool& pool, ffi::Buffer<ffi::F32>& q, ffi::Span<const int64_t> kd,
               ffi::Span<const int64_t> vd, const void* k, const void* v, const uint16_t* ks, const uint16_t* vs,
               ffi::Span<const int64_t> ksd, ffi::Span<const int64_t> vsd, ffi::Buffer<ffi::S32>& block_tables,
               ffi::Buffer<ffi::S32>& token_seq, ffi::Buffer<ffi::S32>& positions,
               ffi::Buffer<ffi::S32>* visible_upto, ffi::Buffer<ffi::S32>& layer,
               ffi::Buffer<ffi::F32>& sinks, float scale, int64_t sliding_window, float soft_cap,
               ffi::ResultBuffer<ffi::F32>& out) {
  auto qd = q.dimensions(), bd = block_tables.dimensions(), od = out->dimensions();
  if (qd.size() != 3) return invalid("q must be [T, Hq, Dh], got " + dims_str(qd));
  if (kd.size() != 4 && kd.size() != 5)
    return invalid("k_cache must be [NB, BS, Hkv, Dh] or [L, NB, BS, Hkv, Dh], got " + dims_str(kd));
  if (!std::equal(kd.begin(), kd.end(), vd.begin(), vd.end()))
    return invalid("k_cache " + dims_str(kd) + " and v_cache " + dims_str(vd) + " differ");
  if (ks) {
    const bool ok = ksd.size() == kd.size() && std::equal(kd.begin(), kd.end() - 1, ksd.begin()) &&
                    ksd.back() == 1 && std::equal(ksd.begin(), ksd.end(), vsd.begin(), vsd.end());
    if (!ok)
      return invalid("k_scale " + dims_str(ksd) + " and v_scale " + dims_str(vsd) + " must be the cache's " +
                     dims_str(kd) + " with a last axis of 1");
  }
  const size_t o = kd.size() - 4;   // 1 for a stacked cache
  const int64_t T = qd[0], Hq = qd[1], Dh = qd[2];
  const int64_t L = o ? kd[0] : 1, NB = kd[o], BS = kd[o + 1], Hkv = kd[o + 2];
  if (kd[o + 3] != Dh) return invalid("head_dim of q " + dims_str(qd) + " and the cache " + dims_str(kd) + " differ");
  if (Hkv <= 0 || Hq % Hkv) return invalid("query heads (" + std::to_string(Hq) + ") must be a multiple of KV heads (" +
                                           std::to_string(Hkv) + ")");
  if (Hq / Hkv > 64) return invalid("at most 64 query heads per KV head, got " + std::to_string(Hq / Hkv));
  if (bd.size() != 2) return invalid("block_tables must be [S, MB], got " + dims_str(bd));
  if (token_seq.dimensions().size() != 1 || token_seq.dimensions()[0] != T)
    return invalid("token_seq must be [T] with T = " + std::to_string(T) + ", got " + dims_str(token_seq.dimensions()));
  if (positions.dimensions().size() != 1 || positions.dimensions()[0] != T)
    return invalid("positions must be [T] with T = " + std::to_string(T) + ", got " + dims_str(positions.dimensions()));
  if (visible_upto && (visible_upto->dimensions().size() != 1 || visible_upto->dimensions()[0] != T))
    return invalid("visible_upto must be [T] with T = " + std::to_string(T) + ", got " +
                   dims_str(visible_upto->dimensions()));
  if (layer.element_count() != 1) return invalid("layer must be a scalar, got " + dims_str(layer.dimensions()));
  if (sinks.element_count() != 0 && (sinks.dimensions().size() != 1 || sinks.dimensions()[0] != Hq))
    return invalid("sinks must be [Hq] with Hq = " + std::to_string(Hq) + " or [0], got " +
                   dims_str(sinks.dimensions()));
  if (!std::equal(qd.begin(), qd.end(), od.begin(), od.end()))
    return invalid("out " + dims_str(od) + " must have q's shape " + dims_str(qd));
  if (T > 0 && (bd[0] <= 0 || bd[1] <= 0 || NB <= 0 || BS <= 0))
    return invalid("empty block_tables " + dims_str(bd) + " or cache " + dims_str(kd));
  if (T == 0 || Dh == 0) return ffi::Error::Success();
  const int64_t li = std::clamp<int64_t>(layer.typed_data()[0], 0, L - 1);
  const int64_t layer_rows = NB * BS * Hkv;
  Problem<KV> P;
  P.q = q.typed_data();
  P.k = reinterpret_cast<const KV*>(k) + li * layer_rows * Dh;
  P.v = reinterpret_cast<const KV*>(v) + li * layer_rows * Dh;
  P.ks = ks ? ks + li * layer_rows : nullptr;
  P.vs = vs ? vs + li * layer_rows : nullptr;
  P.tables = block_tables.typed_data();
  P.seq = token_seq.typed_data();
  P.pos = positions.typed_data();
  P.vis = visible_upto ? visible_upto->typed_data() : nullptr;
  P.sinks = sinks.element_count() ? sinks.typed_data() : nullptr;
  P.out = out->typed_data();
  P.T = T, P.Hq = Hq, P.Hkv = Hkv, P.G = Hq / Hkv, P.Dh = Dh, P.NB = NB, P.BS = BS, P.S = bd[0], P.MB = bd[1];
  P.scale = scale;
  P.soft_cap = soft_cap;
  P.window = sliding_window;
  if (P.vis)
    paged_attention<KV, true>(pool, P);
  else
    paged_attention<KV, false>(pool, P);
  return ffi::Error::Success();
}

// A cache of plain elements: float32, bf16 bits (U16) or fp8 bytes (U8, the format in KV).
template <ffi::DataType KT, typename KV>
ffi::Error PagedAttentionImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<KT> k_cache,
                              ffi::Buffer<KT> v_cache, ffi::Buffer<ffi::S32> block_tables,
                              ffi::Buffer<ffi::S32> token_seq, ffi::Buffer<ffi::S32> positions,
                              ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::F32> sinks, float scale,
                              int64_t sliding_window, float soft_cap, ffi::ResultBuffer<ffi::F32> out) {
  return Run<KV>(pool, q, k_cache.dimensions(), v_cache.dimensions(), k_cache.untyped_data(),
                 v_cache.untyped_data(), nullptr, nullptr, {}, {}, block_tables, token_seq, positions, nullptr,
                 layer, sinks, scale, sliding_window, soft_cap, out);
}

// The same with each query's visible_upto [T] (bidirectional image tokens).
template <ffi::DataType KT, typename KV>
ffi::Error PagedAttentionVisImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<KT> k_cache,
                                 ffi::Buffer<KT> v_cache, ffi::Buffer<ffi::S32> block_tables,
                                 ffi::Buffer<ffi::S32> token_seq, ffi::Buffer<ffi::S32> positions,
                                 ffi::Buffer<ffi::S32> visible_upto, ffi::Buffer<ffi::S32> layer,
                                 ffi::Buffer<ffi::F32> sinks, float scale, int64_t sliding_window, float soft_cap,
                                 ffi::ResultBuffer<ffi::F32> out) {
  return Run<KV>(pool, q, k_cache.dimensions(), v_cache.dimensions(), k_cache.untyped_data(),
                 v_cache.untyped_data(), nullptr, nullptr, {}, {}, block_tables, token_seq, positions, &visible_upto,
                 layer, sinks, scale, sliding_window, soft_cap, out);
}

// An int8 cache with its float16 scales [.., Hkv, 1].
ffi::Error PagedAttentionInt8Impl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::S8> k_cache,
                                  ffi::Buffer<ffi::S8> v_cache, ffi::Buffer<ffi::F16> k_scale,
                                  ffi::Buffer<ffi::F16> v_scale, ffi::Buffer<ffi::S32> block_tables,
                                  ffi::Buffer<ffi::S32> token_seq, ffi::Buffer<ffi::S32> positions,
                                  ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::F32> sinks, float scale,
                                  int64_t sliding_window, float soft_cap, ffi::ResultBuffer<ffi::F32> out) {
  return Run<int8_t>(pool, q, k_cache.dimensions(), v_cache.dimensions(), k_cache.untyped_data(),
                     v_cache.untyped_data(), reinterpret_cast<const uint16_t*>(k_scale.untyped_data()),
                     reinterpret_cast<const uint16_t*>(v_scale.untyped_data()), k_scale.dimensions(),
                     v_scale.dimensions(), block_tables, token_seq, positions, nullptr, layer, sinks, scale,
                     sliding_window, soft_cap, out);
}

ffi::Error PagedAttentionInt8VisImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::S8> k_cache,
                                     ffi::Buffer<ffi::S8> v_cache, ffi::Buffer<ffi::F16> k_scale,
                                     ffi::Buffer<ffi::F16> v_scale, ffi::Buffer<ffi::S32> block_tables,
                                     ffi::Buffer<ffi::S32> token_seq, ffi::Buffer<ffi::S32> positions,
                                     ffi::Buffer<ffi::S32> visible_upto, ffi::Buffer<ffi::S32> layer,
                                     ffi::Buffer<ffi::F32> sinks, float scale, int64_t sliding_window,
                                     float soft_cap, ffi::ResultBuffer<ffi::F32> out) {
  return Run<int8_t>(pool, q, k_cache.dimensions(), v_cache.dimensions(), k_cache.untyped_data(),
                     v_cache.untyped_data(), reinterpret_cast<const uint16_t*>(k_scale.untyped_data()),
                     reinterpret_cast<const uint16_t*>(v_scale.untyped_data()), k_scale.dimensions(),
                     v_scale.dimensions(), block_tables, token_seq, positions, &visible_upto, layer, sinks, scale,
                     sliding_window, soft_cap, out);
}

}  // namespace

// Selects the AVX-512 path (on: where the CPU has it) or the AVX2 one for every later call;
// returns whether AVX-512 is now in use.  For tests and benchmarks (native.set_attention_avx512).
extern "C" int jaxllm_attention_set_avx512(int on) {
  g_avx512 = on && kHasAvx512;
  return g_avx512;
}

// The operands after the cache (and its int8 scales): tables, token_seq, positions,
// [visible_upto,] layer, sinks; then the attributes and the result.
#define JAXLLM_PAGED_ATTENTION_TAIL(VIS)                                   \
  .Arg<ffi::Buffer<ffi::S32>>()      /* tables */                          \
      .Arg<ffi::Buffer<ffi::S32>>()  /* token_seq */                       \
      .Arg<ffi::Buffer<ffi::S32>>()  /* positions */                       \
      VIS                                                                  \
      .Arg<ffi::Buffer<ffi::S32>>()  /* layer */                           \
      .Arg<ffi::Buffer<ffi::F32>>()  /* sinks */                           \
      .Attr<float>("scale")                                                \
      .Attr<int64_t>("sliding_window")                                     \
      .Attr<float>("soft_cap")                                             \
      .Ret<ffi::Buffer<ffi::F32>>()
#define JAXLLM_NO_VIS
#define JAXLLM_VIS .Arg<ffi::Buffer<ffi::S32>>() /* visible_upto */

#define JAXLLM_PAGED_ATTENTION_BINDING(KT, VIS)                                              \
  ffi::Ffi::Bind().Ctx<ffi::ThreadPool>().Arg<ffi::Buffer<ffi::F32>>() /* q */               \
      .Arg<ffi::Buffer<KT>>() /* k_cache */.Arg<ffi::Buffer<KT>>()     /* v_cache */          \
      JAXLLM_PAGED_ATTENTION_TAIL(VIS)

#define JAXLLM_PAGED_ATTENTION_INT8_BINDING(VIS)                                             \
  ffi::Ffi::Bind().Ctx<ffi::ThreadPool>().Arg<ffi::Buffer<ffi::F32>>() /* q */               \
      .Arg<ffi::Buffer<ffi::S8>>().Arg<ffi::Buffer<ffi::S8>>()         /* k/v cache */        \
      .Arg<ffi::Buffer<ffi::F16>>().Arg<ffi::Buffer<ffi::F16>>()       /* k/v scales */       \
      JAXLLM_PAGED_ATTENTION_TAIL(VIS)

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxllmPagedAttentionF32, (PagedAttentionImpl<ffi::DataType::F32, float>),
                              JAXLLM_PAGED_ATTENTION_BINDING(ffi::DataType::F32, JAXLLM_NO_VIS));

// U16 caches are bfloat16 bit patterns (see formats/storage.py).
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxllmPagedAttentionBF16, (PagedAttentionImpl<ffi::DataType::U16, uint16_t>),
                              JAXLLM_PAGED_ATTENTION_BINDING(ffi::DataType::U16, JAXLLM_NO_VIS));

// fp8 caches as uint8 bit patterns (see layers/kv_quant.py); the target names the format.
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxllmPagedAttentionFp8E4M3, (PagedAttentionImpl<ffi::DataType::U8, Fp8E4M3>),
                              JAXLLM_PAGED_ATTENTION_BINDING(ffi::DataType::U8, JAXLLM_NO_VIS));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxllmPagedAttentionFp8E5M2, (PagedAttentionImpl<ffi::DataType::U8, Fp8E5M2>),
                              JAXLLM_PAGED_ATTENTION_BINDING(ffi::DataType::U8, JAXLLM_NO_VIS));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxllmPagedAttentionInt8, PagedAttentionInt8Impl,
                              JAXLLM_PAGED_ATTENTION_INT8_BINDING(JAXLLM_NO_VIS));

// The *Vis targets: the same kernels, each query's key limit extended to its visible_upto.
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxllmPagedAttentionVisF32, (PagedAttentionVisImpl<ffi::DataType::F32, float>),
                              JAXLLM_PAGED_ATTENTION_BINDING(ffi::DataType::F32, JAXLLM_VIS));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxllmPagedAttentionVisBF16, (PagedAttentionVisImpl<ffi::DataType::U16, uint16_t>),
                              JAXLLM_PAGED_ATTENTION_BINDING(ffi::DataType::U16, JAXLLM_VIS));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxllmPagedAttentionVisFp8E4M3, (PagedAttentionVisImpl<ffi::DataType::U8, Fp8E4M3>),
                              JAXLLM_PAGED_ATTENTION_BINDING(ffi::DataType::U8, JAXLLM_VIS));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxllmPagedAttentionVisFp8E5M2, (PagedAttentionVisImpl<ffi::DataType::U8, Fp8E5M2>),
                              JAXLLM_PAGED_ATTENTION_BINDING(ffi::DataType::U8, JAXLLM_VIS));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxllmPagedAttentionVisInt8, PagedAttentionInt8VisImpl,
                              JAXLLM_PAGED_ATTENTION_INT8_BINDING(JAXLLM_VIS));
