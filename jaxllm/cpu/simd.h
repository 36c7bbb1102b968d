// Vector helpers shared by the native CPU kernels (linear.cc, attention.cc, quant_linear.cc,
// quant_dot.cc): AVX2 loads that widen bf16 (stored as uint16 bit patterns, see
// formats/storage.py) to float32, horizontal sum and max, and LineVector, a std::vector on
// cache-line-aligned storage.  Header-only; native.py hashes it with each source it builds.
#pragma once

#include <immintrin.h>

#include <cstddef>
#include <cstdint>
#include <new>
#include <vector>

namespace jaxllm_simd {

// Storage starting on a 64-byte cache line, for the Q4_1 prefill panels (quant_linear.cc,
// quant_dot.cc): they are read by 512-bit loads at multiples of 64 bytes from their start
// (AVX2: 256-bit at multiples of 32), and on std::vector's 16-byte-aligned storage every
// 512-bit one straddled two lines (half the 256-bit ones).  Aligned, the AVX-512 panels'
// calls ran 1.13-1.17x faster at 512 rows (docs/BENCHMARKS.md, "Panels on cache lines").
template <typename T>
struct LineAllocator {
  using value_type = T;
  LineAllocator() = default;
  template <typename U>
  LineAllocator(const LineAllocator<U>&) {}
  T* allocate(std::size_t n) { return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t{64})); }
  void deallocate(T* p, std::size_t) { ::operator delete(p, std::align_val_t{64}); }
  template <typename U>
  bool operator==(const LineAllocator<U>&) const { return true; }
  template <typename U>
  bool operator!=(const LineAllocator<U>&) const { return false; }
};
template <typename T>
using LineVector = std::vector<T, LineAllocator<T>>;

// 8 values at p as float32.
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) {
  __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline float to_f32(float v) { return v; }
inline float to_f32(uint16_t v) {
  uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  __builtin_memcpy(&f, &bits, 4);
  return f;
}

inline float hsum(__m256 v) {
  __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
  lo = _mm_add_ps(lo, hi);
  lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
  lo = _mm_add_ss(lo, _mm_shuffle_ps(lo, lo, 1));
  return _mm_cvtss_f32(lo);
}

inline float hmax(__m256 v) {
  __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
  lo = _mm_max_ps(lo, hi);
  lo = _mm_max_ps(lo, _mm_movehl_ps(lo, lo));
  lo = _mm_max_ss(lo, _mm_shuffle_ps(lo, lo, 1));
  return _mm_cvtss_f32(lo);
}

}  // namespace jaxllm_simd
