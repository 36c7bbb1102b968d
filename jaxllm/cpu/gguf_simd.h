// What the packed-block matmuls (quant_linear.cc, quant_dot.cc) share: AVX2 readers of
// GGUF's 32-weight block fields (jaxllm/quant/gguf_blocks.py has the layouts), the walk over
// tiles of x and weight rows, and the split of the weight rows over XLA's thread pool.
// Header-only; native.py hashes it with each source it builds.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "parallel.h"
#include "xla/ffi/api/ffi.h"

namespace jaxllm_gguf {

constexpr int kMaxRows = 4;            // rows of x per tile: 4 weight vectors + 4 accumulators + partials
constexpr int64_t kPrefetchRows = 16;  // weight rows ahead whose fields are requested (see prefetch)

inline float f16(uint16_t bits) { return _cvtsh_ss(bits); }

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

constexpr int64_t kChunk8 = 8;   // f16 scales converted at once: one vcvtph2ps

// Values [c0, c0 + cn) of a row of nb f16 values (row: its first) as 8 float32 lanes, lanes
// past cn +0.  A row's last chunk (cn < 8) is read as the row's last 8 values, moved down
// into place: no read past the row, and no copy through memory (a 16-byte load of values
// just stored 2 bytes at a time waits for the stores: ~2x the kernel's time at K = 576).
inline __m256 f16x8(const uint16_t* row, int64_t nb, int64_t c0, int64_t cn, __m256 lanes) {
  if (cn == kChunk8) return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + c0)));
  if (nb >= kChunk8) {
    const __m256 last = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + nb - kChunk8)));
    const __m256i from = _mm256_add_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
                                          _mm256_set1_epi32(static_cast<int>(kChunk8 - cn)));
    return _mm256_and_ps(_mm256_permutevar8x32_ps(last, from), lanes);
  }
  alignas(16) uint16_t tail[kChunk8] = {};   // a row shorter than a chunk (K < 256)
  std::copy(row + c0, row + c0 + cn, tail);
  return _mm256_cvtph_ps(_mm_load_si128(reinterpret_cast<const __m128i*>(tail)));
}

// Lanes 0 .. cn - 1 of 8 all ones, the others zero: a chunk's blocks (cn <= 8) for maskload.
inline __m256i chunk_lanes(int64_t cn) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(cn)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

// Q4_1's several-rows walks (quant_linear.cc's float32 one, quant_dot.cc's int16 one): as a
// pass over NR weight rows reaches chunk c0, the same chunk of d and m `ahead` rows on is
// requested, and as it reaches block b, every 4 blocks, that cache line of their qs (16 bytes
// a block).
template <int NR>
inline void prefetch_q4_1_scales(const uint16_t* d, const uint16_t* m, int64_t nb, int64_t c0, int64_t ahead) {
#pragma GCC unroll 4
  for (int j = 0; j < NR; ++j) {
    _mm_prefetch(reinterpret_cast<const char*>(d + (j + ahead) * nb + c0), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(m + (j + ahead) * nb + c0), _MM_HINT_T0);
  }
}

template <int NR>
inline void prefetch_q4_1_quants(const uint8_t* qs, int64_t nb, int64_t b, int64_t ahead) {
  if (b % 4 != 0) return;
#pragma GCC unroll 4
  for (int j = 0; j < NR; ++j)
    _mm_prefetch(reinterpret_cast<const char*>(qs + ((j + ahead) * nb + b) * 16), _MM_HINT_T0);
}

inline void prefetch(const void* p, int64_t bytes);

// The first `rows` weight rows of a part starting at n0, all three Q4_1 fields: a part's walk
// would otherwise begin on a cold stream (see rows_range_prefetched).
inline void prefetch_q4_1_rows(const uint16_t* d, const uint16_t* m, const uint8_t* qs, int64_t nb, int64_t n0,
                               int64_t rows) {
  prefetch(qs + n0 * nb * 16, rows * nb * 16);
  prefetch(d + n0 * nb, rows * nb * 2);
  prefetch(m + n0 * nb, rows * nb * 2);
}

// Asks for the cache lines of [p, p + bytes) to be brought in: a matmul streams weight rows
// that are in L3 at best, and asking for a later row while this one is computed hides the
// latency the hardware prefetcher leaves (it follows one row's short field streams late).
inline void prefetch(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t o = 0; o < bytes; o += 64) _mm_prefetch(c + o, _MM_HINT_T0);
}

// Requests weight row n + kPrefetchRows while row n is computed, and rows n0 .. n0 +
// kPrefetchRows - 1 as a part [n0, n1) starts (otherwise each part, and so each call,
// would begin on a cold stream: 60 back-to-back calls of the built-in model's layer shapes
// streamed their weights from DRAM 1.2x slower than one call over the same bytes).
// prefetch_row(n): the prefetches of weight row n's fields.
template <typename Tile, typename PrefetchRow>
inline void rows_range_prefetched(int64_t M, int64_t n0, int64_t n1, const PrefetchRow& prefetch_row,
                                  const Tile& tile);

// Calls tile(rows, r0, n) for every tile of x (rows r0 .. r0 + rows - 1, at most kMaxRows)
// and every weight row n in [n0, n1).  The tile of x (at most kMaxRows * K floats) is the
// outer loop: it is read 4 times per block per weight row, so it stays in L1 while the
// weight rows (about a quarter of its bytes per block) stream through.
template <typename Tile>
inline void rows_range(int64_t M, int64_t n0, int64_t n1, const Tile& tile) {
  const int64_t tiles = (M + kMaxRows - 1) / kMaxRows;
  int64_t r0 = 0;
  for (int64_t t = 0; t < tiles; ++t) {
    // tiles as even as possible (7 rows: 4 + 3, not 4 + 3 ... or a 1-row tail)
    const int rows = static_cast<int>(M / tiles + (t < M % tiles));
    for (int64_t n = n0; n < n1; ++n) tile(rows, r0, n);
    r0 += rows;
  }
}

template <typename Tile, typename PrefetchRow>
inline void rows_range_prefetched(int64_t M, int64_t n0, int64_t n1, const PrefetchRow& prefetch_row,
                                  const Tile& tile) {
  for (int64_t n = n0; n < std::min(n1, n0 + kPrefetchRows); ++n) prefetch_row(n);
  rows_range(M, n0, n1, [&](int rows, int64_t r0, int64_t n) {
    if (n + kPrefetchRows < n1) prefetch_row(n + kPrefetchRows);
    tile(rows, r0, n);
  });
}

// Splits the N weight rows over the pool in contiguous ranges and runs range(n0, n1) on each.
template <typename Range>
void split_rows(xla::ffi::ThreadPool& pool, int64_t M, int64_t N, const Range& range) {
  // Parts per thread and tasks = threads - 1 (the caller works too): the choices linear.cc
  // measured for the same pool; a part is at least 8 weight rows.
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  const int64_t per_thread = M > 8 ? 8 : 4;
  const int parts = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(per_thread * threads, N / 8)));
  if (parts == 1) {
    range(0, N);
    return;
  }
  const int64_t chunk = (N + parts - 1) / parts;
  const int64_t tasks = std::max<int64_t>(1, std::min<int64_t>(threads - 1, parts - 1));
  jaxllm_parallel::for_each_item(pool, parts, tasks, [&range, chunk, N](int64_t i) {
    const int64_t a = std::min<int64_t>(N, i * chunk), b = std::min<int64_t>(N, a + chunk);
    if (a < b) range(a, b);
  });
}

}  // namespace jaxllm_gguf
