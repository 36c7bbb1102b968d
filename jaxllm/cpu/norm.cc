// Native CPU RMSNorm for XLA: y[t, :] = w * (x[t, :] * rsqrt(mean(x[t, :]^2) + eps)), float32,
// the function of layers/norm.py's rms_norm.
//
// Why a kernel for a few thousand flops: XLA:CPU sums a row's squares in an order that
// depends on the step's shape (it rewrites a long row reduction into 32-wide windows for
// some numbers of rows and not for others, and fuses the squares into the sum, contracting
// them into FMAs, in some programs and not in others), so the same token's norm, and so its
// logits, differed in the last bits between a decode step and a speculative verification.
// Here every row is summed in one fixed order whatever the number of rows: 8 lanes of
// squares (a multiply, then an add: no contraction), the lanes' sums added pairwise, then the
// tail.  Called from jaxllm/cpu/native.py via XLA's FFI.
#include <immintrin.h>

#include <cmath>
#include <cstdint>

#include "simd.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// The row's mean square, in the same order for every row and every call.
inline float mean_square(const float* x, int64_t D) {
  __m256 acc = _mm256_setzero_ps();
  int64_t d = 0;
  for (; d + 8 <= D; d += 8) {
    const __m256 v = _mm256_loadu_ps(x + d);
    acc = _mm256_add_ps(acc, _mm256_mul_ps(v, v));   // two roundings, as written: no FMA
  }
  float s = jaxllm_simd::hsum(acc);
  for (; d < D; ++d) {
    const float sq = x[d] * x[d];
    s = s + sq;
  }
  return s / static_cast<float>(D);
}

ffi::Error RmsNorm(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w, float eps, ffi::ResultBuffer<ffi::F32> y) {
  auto xd = x.dimensions();
  auto wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 1 || wd[0] != xd[1])
    return ffi::Error::InvalidArgument("jaxllm_rms_norm_f32: expected x [T, D] and w [D]");
  const int64_t T = xd[0], D = xd[1];
  const float* xp = x.typed_data();
  const float* wp = w.typed_data();
  float* yp = y->typed_data();
  for (int64_t t = 0; t < T; ++t) {
    const float* xr = xp + t * D;
    float* yr = yp + t * D;
    const float r = 1.0f / std::sqrt(mean_square(xr, D) + eps);
    const __m256 rv = _mm256_set1_ps(r);
    int64_t d = 0;
    for (; d + 8 <= D; d += 8)
      _mm256_storeu_ps(yr + d, _mm256_mul_ps(_mm256_loadu_ps(wp + d), _mm256_mul_ps(_mm256_loadu_ps(xr + d), rv)));
    for (; d < D; ++d) yr[d] = wp[d] * (xr[d] * r);
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxllmRmsNormF32, RmsNorm,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // x [T, D]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // w [D]
                                  .Attr<float>("eps")
                                  .Ret<ffi::Buffer<ffi::F32>>());
