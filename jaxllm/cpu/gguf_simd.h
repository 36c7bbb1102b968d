// AVX2 readers of GGUF's 32-weight block fields (jaxllm/quant/gguf_blocks.py has the
// layouts), shared by the packed-block matmuls (quant_linear.cc, quant_dot.cc).
// Header-only; native.py hashes it with each source it builds.
#pragma once

#include <immintrin.h>

#include <cstdint>

namespace jaxllm_gguf {

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

// Asks for the cache lines of [p, p + bytes) to be brought in: a matmul streams weight rows
// that are in L3 at best, and asking for a later row while this one is computed hides the
// latency the hardware prefetcher leaves (it follows one row's short field streams late).
inline void prefetch(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t o = 0; o < bytes; o += 64) _mm_prefetch(c + o, _MM_HINT_T0);
}

}  // namespace jaxllm_gguf
