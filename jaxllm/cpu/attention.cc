// Native CPU paged attention for XLA: the function of paged_attention_xla
// (jaxllm/layers/attention.py), reading a paged KV cache that write_kv has already updated.
//
// XLA:CPU runs the plain-XLA path as gathers of whole 128-position K/V chunks per token
// (transpose copies) and tiny batched einsums: at batch 32 with ~100-token contexts that
// measured 1.0-2.9 ms per layer for ~1.2 MB of cache and ~7 MFLOP (docs/architecture.md).  Here each (token, KV head) work
// item walks exactly the positions it may see through its sequence's block table, reads
// each K/V row once for all G = Hq / Hkv query heads of that KV head, and keeps an online
// softmax in float32 registers and a small scratch.  Items are spread over XLA's intra-op
// thread pool by parallel.h, as linear.cc's panels are.  Called from jaxllm/cpu/attention.py
// via XLA's FFI.
//
//   q            [T, Hq, Dh]              float32
//   k/v cache    [NB, BS, Hkv, Dh]        float32 or uint16 (bfloat16 bits, see formats/storage.py),
//                or [L, NB, BS, Hkv, Dh]  stacked over layers, read at layer[]; or quantized
//                (--kv-cache-dtype, layers/kv_quant.py): int8 with k/v scales [.., Hkv, 1]
//                float16 beside it, or fp8 e4m3fn / e5m2 as uint8 bits (scale 1.0)
//   block_tables [S, MB] int32, token_seq [T] int32, positions [T] int32, layer [] int32
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
// Token t of sequence s = token_seq[t] attends over positions [lo, positions[t]] with
// lo = max(0, positions[t] + 1 - sliding_window) (or 0), position p living in block
// block_tables[s, p / BS] at offset p % BS.
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <type_traits>
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
  const float* sinks;      // [Hq] or null: no sinks
  float* out;              // [T, Hq, Dh]
  int64_t T, Hq, Hkv, G, Dh, NB, BS, S, MB;
  float scale;
  float soft_cap;          // <= 0: none
  int64_t window;          // <= 0: no sliding window

  // Visible positions [lo, hi) of token t.  Defensive for padding and bad input: hi is
  // capped at what a block table row can address, and an empty range gives zeros.
  void range(int64_t t, int64_t* lo, int64_t* hi) const {
    const int64_t len = std::min<int64_t>(static_cast<int64_t>(pos[t]) + 1, MB * BS);
    *hi = std::max<int64_t>(len, 0);
    *lo = window > 0 ? std::max<int64_t>(0, len - window) : 0;
  }
};

// Scratch of one worker thread, sized for the call's G and Dh.
template <typename KV>
struct Scratch {
  std::vector<float> qs, acc, s, m, l;   // [G, Dh], [G, Dh], [G, kTile], [G], [G]
  std::vector<const KV*> krow, vrow;     // [kTile] row pointers into the cache
  float ksc[kTile], vsc[kTile];          // the tile's int8 row scales
  void resize(int64_t G, int64_t Dh) {
    qs.resize(G * Dh);
    acc.resize(G * Dh);
    s.resize(G * kTile);
    m.resize(G);
    l.resize(G);
    krow.resize(kTile);
    vrow.resize(kTile);
  }
};

// Scores s[g, j] = q_g . k_j for heads g0 .. g0 + NH and rows j < n, two rows at a time.
template <int NH, typename KV>
inline void scores(const float* qs, const KV* const* krow, float* s, int64_t n, int64_t Dh, int64_t g0) {
  const float* qh = qs + g0 * Dh;
  const int64_t d8 = Dh / 8 * 8;
  int64_t j = 0;
  for (; j + 2 <= n; j += 2) {
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
    for (int i = 0; i < NH; ++i) {
      float x0, x1;
      hsum2(a0[i], a1[i], &x0, &x1);
      for (int64_t d = d8; d < Dh; ++d) {
        x0 += qh[i * Dh + d] * to_f32(krow[j][d]);
        x1 += qh[i * Dh + d] * to_f32(krow[j + 1][d]);
      }
      s[(g0 + i) * kTile + j] = x0;
      s[(g0 + i) * kTile + j + 1] = x1;
    }
  }
  for (; j < n; ++j) {
    __m256 a[NH];
    for (int i = 0; i < NH; ++i) a[i] = _mm256_setzero_ps();
    for (int64_t d = 0; d < d8; d += 8) {
      const __m256 kv = load8(krow[j] + d);
      for (int i = 0; i < NH; ++i) a[i] = _mm256_fmadd_ps(_mm256_loadu_ps(qh + i * Dh + d), kv, a[i]);
    }
    for (int i = 0; i < NH; ++i) {
      float x = hsum(a[i]);
      for (int64_t d = d8; d < Dh; ++d) x += qh[i * Dh + d] * to_f32(krow[j][d]);
      s[(g0 + i) * kTile + j] = x;
    }
  }
}

// acc[g, :] = acc[g, :] * corr[g] + sum_j p[g, j] v_j for heads g0 .. g0 + NH, where p sits
// where the scores were.  Columns outermost: the sum over the tile's rows stays in
// registers and the accumulators in memory are touched once per tile.
template <int NH, typename KV>
inline void values(const float* p, const KV* const* vrow, float* acc, const float* corr, int64_t n, int64_t Dh,
                   int64_t g0) {
  const float* ph = p + g0 * kTile;
  float* ah = acc + g0 * Dh;
  int64_t d = 0;
  for (; d + 16 <= Dh; d += 16) {
    __m256 a0[NH], a1[NH];
    for (int i = 0; i < NH; ++i) a0[i] = a1[i] = _mm256_setzero_ps();
    for (int64_t j = 0; j < n; ++j) {
      const __m256 v0 = load8(vrow[j] + d), v1 = load8(vrow[j] + d + 8);
      for (int i = 0; i < NH; ++i) {
        const __m256 pj = _mm256_broadcast_ss(ph + i * kTile + j);
        a0[i] = _mm256_fmadd_ps(pj, v0, a0[i]);
        a1[i] = _mm256_fmadd_ps(pj, v1, a1[i]);
      }
    }
    for (int i = 0; i < NH; ++i) {
      const __m256 c = _mm256_set1_ps(corr[g0 + i]);
      float* o = ah + i * Dh + d;
      _mm256_storeu_ps(o, _mm256_fmadd_ps(_mm256_loadu_ps(o), c, a0[i]));
      _mm256_storeu_ps(o + 8, _mm256_fmadd_ps(_mm256_loadu_ps(o + 8), c, a1[i]));
    }
  }
  for (; d + 8 <= Dh; d += 8) {
    __m256 a[NH];
    for (int i = 0; i < NH; ++i) a[i] = _mm256_setzero_ps();
    for (int64_t j = 0; j < n; ++j) {
      const __m256 vv = load8(vrow[j] + d);
      for (int i = 0; i < NH; ++i) a[i] = _mm256_fmadd_ps(_mm256_broadcast_ss(ph + i * kTile + j), vv, a[i]);
    }
    for (int i = 0; i < NH; ++i) {
      float* o = ah + i * Dh + d;
      _mm256_storeu_ps(o, _mm256_fmadd_ps(_mm256_loadu_ps(o), _mm256_set1_ps(corr[g0 + i]), a[i]));
    }
  }
  for (; d < Dh; ++d) {   // head dims that are not a multiple of 8
    for (int i = 0; i < NH; ++i) {
      float x = 0.f;
      for (int64_t j = 0; j < n; ++j) x += ph[i * kTile + j] * to_f32(vrow[j][d]);
      ah[i * Dh + d] = ah[i * Dh + d] * corr[g0 + i] + x;
    }
  }
}

// Heads of a KV head's group in passes of at most kHeads (any G).
template <typename KV>
void scores_all(const float* qs, const KV* const* krow, float* s, int64_t n, int64_t Dh, int64_t G) {
  int64_t g = 0;
  for (; g + kHeads <= G; g += kHeads) scores<kHeads>(qs, krow, s, n, Dh, g);
  switch (G - g) {
    case 3: scores<3>(qs, krow, s, n, Dh, g); break;
    case 2: scores<2>(qs, krow, s, n, Dh, g); break;
    case 1: scores<1>(qs, krow, s, n, Dh, g); break;
    default: break;
  }
}

template <typename KV>
void values_all(const float* p, const KV* const* vrow, float* acc, const float* corr, int64_t n, int64_t Dh,
                int64_t G) {
  int64_t g = 0;
  for (; g + kHeads <= G; g += kHeads) values<kHeads>(p, vrow, acc, corr, n, Dh, g);
  switch (G - g) {
    case 3: values<3>(p, vrow, acc, corr, n, Dh, g); break;
    case 2: values<2>(p, vrow, acc, corr, n, Dh, g); break;
    case 1: values<1>(p, vrow, acc, corr, n, Dh, g); break;
    default: break;
  }
}

// Work item (t, h): out[t, h*G : (h+1)*G, :] from the visible positions of token t.
template <typename KV>
void attend_item(const Problem<KV>& P, int64_t t, int64_t h, Scratch<KV>& w) {
  const int64_t G = P.G, Dh = P.Dh;
  int64_t lo, hi;
  P.range(t, &lo, &hi);
  float* out = P.out + (t * P.Hq + h * G) * Dh;   // [G, Dh], the group's heads are adjacent
  if (lo >= hi) {
    std::fill(out, out + G * Dh, 0.f);
    return;
  }
  // Queries scaled before the dot, as the XLA path does (q * scale, then q . k).
  const float* q = P.q + (t * P.Hq + h * G) * Dh;
  for (int64_t i = 0; i < G * Dh; ++i) w.qs[i] = q[i] * P.scale;
  std::fill(w.acc.begin(), w.acc.end(), 0.f);
  std::fill(w.m.begin(), w.m.end(), -INFINITY);
  std::fill(w.l.begin(), w.l.end(), 0.f);
  // Clamped so that a padding token (or a bad index) reads some row of the cache instead
  // of outside it; its output is not used.
  const int64_t seq = std::clamp<int64_t>(P.seq[t], 0, P.S - 1);
  const int32_t* table = P.tables + seq * P.MB;
  const KV** krow = w.krow.data();
  const KV** vrow = w.vrow.data();
  float corr[64];   // G <= 64 (checked by the handler)
  for (int64_t j0 = lo; j0 < hi; j0 += kTile) {
    const int64_t n = std::min(kTile, hi - j0);
    // Block column and offset stepped along: one integer division per tile, not per position.
    int64_t col = j0 / P.BS, off = j0 % P.BS;
    int64_t blk = std::clamp<int64_t>(table[col], 0, P.NB - 1);
    for (int64_t j = 0; j < n; ++j, ++off) {
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
    for (int64_t j = 0; j < n; ++j)
      for (int64_t b = 0; b < Dh * static_cast<int64_t>(sizeof(KV)); b += 64) {
        _mm_prefetch(reinterpret_cast<const char*>(krow[j]) + b, _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(vrow[j]) + b, _MM_HINT_T0);
      }
    scores_all<KV>(w.qs.data(), krow, w.s.data(), n, Dh, G);
    if (P.ks)   // int8: q . (scale_j k_j) = scale_j (q . k_j)
      for (int64_t g = 0; g < G; ++g)
        for (int64_t j = 0; j < n; ++j) w.s[g * kTile + j] *= w.ksc[j];
    if (P.soft_cap > 0.f) {   // Gemma 2: cap * tanh(s / cap) on the scaled scores
      const float cap = P.soft_cap, inv_cap = 1.f / P.soft_cap;
      for (int64_t g = 0; g < G; ++g)
        for (int64_t j = 0; j < n; ++j) w.s[g * kTile + j] = cap * std::tanh(w.s[g * kTile + j] * inv_cap);
    }
    // Online softmax: new running max per head, scores -> exp(s - max) in place (rows past
    // n set to -inf give 0), accumulators rescaled by exp(old max - new max).
    for (int64_t g = 0; g < G; ++g) {
      float* s = w.s.data() + g * kTile;
      std::fill(s + n, s + kTile, -INFINITY);
      __m256 mx = _mm256_set1_ps(-INFINITY);
      for (int64_t j = 0; j < kTile; j += 8) mx = _mm256_max_ps(mx, _mm256_loadu_ps(s + j));
      const float m_new = std::max(w.m[g], hmax(mx));
      const __m256 mv = _mm256_set1_ps(m_new);
      __m256 sum = _mm256_setzero_ps();
      for (int64_t j = 0; j < kTile; j += 8) {
        const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + j), mv));
        _mm256_storeu_ps(s + j, e);
        sum = _mm256_add_ps(sum, e);
      }
      corr[g] = std::exp(w.m[g] - m_new);   // 0 on the first tile (m = -inf)
      w.l[g] = w.l[g] * corr[g] + hsum(sum);
      w.m[g] = m_new;
      if (P.vs)   // int8: p_j (scale_j v_j) = (p_j scale_j) v_j; the sum l keeps p_j
        for (int64_t j = 0; j < n; ++j) s[j] *= w.vsc[j];
    }
    values_all<KV>(w.s.data(), vrow, w.acc.data(), corr, n, Dh, G);
  }
  for (int64_t g = 0; g < G; ++g) {
    float inv = 1.f / w.l[g];   // l >= 1: the maximum's own term is exp(0)
    if (P.sinks) {
      // The sink's exp joins the denominator: acc / (l + exp(sink - m)), both exponentials
      // taken against the larger of m and the sink.
      const float sink = P.sinks[h * G + g], top = std::max(w.m[g], sink), c = std::exp(w.m[g] - top);
      inv = c / (w.l[g] * c + std::exp(sink - top));
    }
    for (int64_t d = 0; d < Dh; ++d) out[g * Dh + d] = w.acc[g * Dh + d] * inv;
  }
}

template <typename KV>
void paged_attention(ffi::ThreadPool& pool, const Problem<KV>& P) {
  const int64_t items = P.T * P.Hkv;
  if (items == 0) return;
  // Helpers only when the call is worth waking them: a task costs microseconds to start,
  // a decode of a short context is less than that.
  int64_t cost = 0;   // multiply-adds of q . k over the batch
  for (int64_t t = 0; t < P.T; ++t) {
    int64_t lo, hi;
    P.range(t, &lo, &hi);
    cost += std::max<int64_t>(hi - lo, 0) * P.Hq * P.Dh;
  }
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  const int64_t helpers = std::min({threads, items - 1, cost / 32768});
  // Items are (token, KV head), token-major: a token's heads, and a sequence's tokens, are
  // claimed close together and share cache rows.  P is copied: a helper task may start after
  // this call has returned (and then finds no item).
  jaxllm_parallel::for_each_item(
      pool, items, helpers,
      [G = P.G, Dh = P.Dh] {
        Scratch<KV> w;
        w.resize(G, Dh);
        return w;
      },
      [P](int64_t i, Scratch<KV>& w) { attend_item<KV>(P, i / P.Hkv, i % P.Hkv, w); });
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
               ffi::Buffer<ffi::S32>& token_seq, ffi::Buffer<ffi::S32>& positions, ffi::Buffer<ffi::S32>& layer,
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
  P.sinks = sinks.element_count() ? sinks.typed_data() : nullptr;
  P.out = out->typed_data();
  P.T = T, P.Hq = Hq, P.Hkv = Hkv, P.G = Hq / Hkv, P.Dh = Dh, P.NB = NB, P.BS = BS, P.S = bd[0], P.MB = bd[1];
  P.scale = scale;
  P.soft_cap = soft_cap;
  P.window = sliding_window;
  paged_attention<KV>(pool, P);
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
                 v_cache.untyped_data(), nullptr, nullptr, {}, {}, block_tables, token_seq, positions, layer,
                 sinks, scale, sliding_window, soft_cap, out);
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
                     v_scale.dimensions(), block_tables, token_seq, positions, layer, sinks, scale, sliding_window,
                     soft_cap, out);
}

}  // namespace

#define JAXLLM_PAGED_ATTENTION_BINDING(KT)          \
  ffi::Ffi::Bind()                                  \
      .Ctx<ffi::ThreadPool>()                       \
      .Arg<ffi::Buffer<ffi::F32>>()  /* q */        \
      .Arg<ffi::Buffer<KT>>()        /* k_cache */  \
      .Arg<ffi::Buffer<KT>>()        /* v_cache */  \
      .Arg<ffi::Buffer<ffi::S32>>()  /* tables */   \
      .Arg<ffi::Buffer<ffi::S32>>()  /* token_seq */\
      .Arg<ffi::Buffer<ffi::S32>>()  /* positions */\
      .Arg<ffi::Buffer<ffi::S32>>()  /* layer */    \
      .Arg<ffi::Buffer<ffi::F32>>()  /* sinks */    \
      .Attr<float>("scale")                         \
      .Attr<int64_t>("sliding_window")              \
      .Attr<float>("soft_cap")                      \
      .Ret<ffi::Buffer<ffi::F32>>()

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxllmPagedAttentionF32, (PagedAttentionImpl<ffi::DataType::F32, float>),
                              JAXLLM_PAGED_ATTENTION_BINDING(ffi::DataType::F32));

// U16 caches are bfloat16 bit patterns (see formats/storage.py).
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxllmPagedAttentionBF16, (PagedAttentionImpl<ffi::DataType::U16, uint16_t>),
                              JAXLLM_PAGED_ATTENTION_BINDING(ffi::DataType::U16));

// fp8 caches as uint8 bit patterns (see layers/kv_quant.py); the target names the format.
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxllmPagedAttentionFp8E4M3, (PagedAttentionImpl<ffi::DataType::U8, Fp8E4M3>),
                              JAXLLM_PAGED_ATTENTION_BINDING(ffi::DataType::U8));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxllmPagedAttentionFp8E5M2, (PagedAttentionImpl<ffi::DataType::U8, Fp8E5M2>),
                              JAXLLM_PAGED_ATTENTION_BINDING(ffi::DataType::U8));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxllmPagedAttentionInt8, PagedAttentionInt8Impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // q
                                  .Arg<ffi::Buffer<ffi::S8>>()    // k_cache
                                  .Arg<ffi::Buffer<ffi::S8>>()    // v_cache
                                  .Arg<ffi::Buffer<ffi::F16>>()   // k_scale
                                  .Arg<ffi::Buffer<ffi::F16>>()   // v_scale
                                  .Arg<ffi::Buffer<ffi::S32>>()   // tables
                                  .Arg<ffi::Buffer<ffi::S32>>()   // token_seq
                                  .Arg<ffi::Buffer<ffi::S32>>()   // positions
                                  .Arg<ffi::Buffer<ffi::S32>>()   // layer
                                  .Arg<ffi::Buffer<ffi::F32>>()   // sinks
                                  .Attr<float>("scale")
                                  .Attr<int64_t>("sliding_window")
                                  .Attr<float>("soft_cap")
                                  .Ret<ffi::Buffer<ffi::F32>>());
