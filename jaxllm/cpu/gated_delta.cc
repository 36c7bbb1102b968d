// Native CPU one-token update of the gated delta rule (Gated DeltaNet: Qwen3-Next / Qwen3.5)
// for XLA, on the layer's state slots in place: the decode step of layers/gated_delta.py's
// _token_step, per sequence s and value head h, with a = exp(g):
//
//   d = beta (v - a S^T k),   S' = a S + k d^T,   o = S'^T q = a S^T q + (k . q) d
//
// Why a kernel: in XLA the update read a sequence's 2 MiB state (32 heads of 128 x 128
// float32) out of the slot array into a copy, contracted the copy, updated it into another
// and wrote that back, about five passes over the state per sequence and step.  Here each
// (sequence, head) state is walked in column tiles that stay in L1 between the tile's two
// passes, so the state is read from memory once and written once.  Every (sequence, head)
// is computed in one fixed order whatever the batch and whichever thread runs it.
// Called from jaxllm/cpu/native.py (gdn_token) via XLA's FFI, the state array aliased in and out.
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>

#include "parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kTile = 32;   // state columns a tile: 4 x 8 lanes of S^T k and of S^T q in registers

struct Problem {
  const float *q, *k, *v, *g, *beta;   // [S, H, Dk] / [S, H, Dv] / [S, H]
  const int32_t *rows, *fresh;         // [S]: the sequence's state row (out of range: none), starts from zeros
  float* states;                       // [R, H, Dk, Dv]
  float* o;                            // [S, H, Dv]
  int64_t S, R, H, Dk, Dv;
};

// Columns [e0, e0 + W) of one (sequence, head) state: the contraction over the tile's
// Dk x W values, then their update from L1.  W is kTile, or the tail (any width).
void tile(const Problem& P, float* st, const float* q, const float* k, const float* v, float a, float b,
          float kq, bool fresh, float* o, int64_t e0, int64_t W) {
  const int64_t Dk = P.Dk, Dv = P.Dv;
  alignas(32) float sk[kTile], sq[kTile], dcol[kTile];
  std::fill(sk, sk + W, 0.0f);
  std::fill(sq, sq + W, 0.0f);
  if (!fresh) {
    if (W == kTile) {
      __m256 ak[4], aq[4];
      for (int j = 0; j < 4; ++j) ak[j] = aq[j] = _mm256_setzero_ps();
      for (int64_t d = 0; d < Dk; ++d) {
        const float* row = st + d * Dv + e0;
        const __m256 kd = _mm256_set1_ps(k[d]), qd = _mm256_set1_ps(q[d]);
        for (int j = 0; j < 4; ++j) {
          const __m256 s = _mm256_loadu_ps(row + 8 * j);
          ak[j] = _mm256_fmadd_ps(kd, s, ak[j]);
          aq[j] = _mm256_fmadd_ps(qd, s, aq[j]);
        }
      }
      for (int j = 0; j < 4; ++j) {
        _mm256_store_ps(sk + 8 * j, ak[j]);
        _mm256_store_ps(sq + 8 * j, aq[j]);
      }
    } else {
      for (int64_t d = 0; d < Dk; ++d) {
        const float* row = st + d * Dv + e0;
        for (int64_t j = 0; j < W; ++j) {
          sk[j] = std::fma(k[d], row[j], sk[j]);
          sq[j] = std::fma(q[d], row[j], sq[j]);
        }
      }
    }
  }
  for (int64_t j = 0; j < W; ++j) {
    dcol[j] = (v[e0 + j] - a * sk[j]) * b;
    o[e0 + j] = a * sq[j] + kq * dcol[j];
  }
  // A fresh sequence's state is zeros (its row may hold an ended sequence's): S' = k d^T.
  const float keep = fresh ? 0.0f : a;
  if (W == kTile) {
    const __m256 av = _mm256_set1_ps(keep);
    __m256 dv[4];
    for (int j = 0; j < 4; ++j) dv[j] = _mm256_load_ps(dcol + 8 * j);
    for (int64_t d = 0; d < Dk; ++d) {
      float* row = st + d * Dv + e0;
      const __m256 kd = _mm256_set1_ps(k[d]);
      for (int j = 0; j < 4; ++j) {
        const __m256 s = fresh ? _mm256_setzero_ps() : _mm256_mul_ps(av, _mm256_loadu_ps(row + 8 * j));
        _mm256_storeu_ps(row + 8 * j, _mm256_fmadd_ps(kd, dv[j], s));
      }
    }
  } else {
    for (int64_t d = 0; d < Dk; ++d) {
      float* row = st + d * Dv + e0;
      for (int64_t j = 0; j < W; ++j) row[j] = std::fma(k[d], dcol[j], fresh ? 0.0f : keep * row[j]);
    }
  }
}

// One (sequence, head): its state in place and its output row.
void item(const Problem& P, int64_t s, int64_t h) {
  const int64_t Dk = P.Dk, Dv = P.Dv;
  float* o = P.o + (s * P.H + h) * Dv;
  const int64_t r = P.rows[s];
  if (r < 0 || r >= P.R) {   // a padding sequence: no state, zero output
    std::fill(o, o + Dv, 0.0f);
    return;
  }
  const float* q = P.q + (s * P.H + h) * Dk;
  const float* k = P.k + (s * P.H + h) * Dk;
  const float* v = P.v + (s * P.H + h) * Dv;
  const float a = std::exp(P.g[s * P.H + h]), b = P.beta[s * P.H + h];
  float kq = 0.0f;
  for (int64_t d = 0; d < Dk; ++d) kq = std::fma(k[d], q[d], kq);
  float* st = P.states + (r * P.H + h) * Dk * Dv;
  for (int64_t e0 = 0; e0 < Dv; e0 += kTile)
    tile(P, st, q, k, v, a, b, kq, P.fresh[s] != 0, o, e0, std::min(kTile, Dv - e0));
}

ffi::Error invalid(const std::string& what) { return ffi::Error::InvalidArgument("jaxllm_gdn_token_f32: " + what); }

ffi::Error GdnToken(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k, ffi::Buffer<ffi::F32> v,
                    ffi::Buffer<ffi::F32> g, ffi::Buffer<ffi::F32> beta, ffi::Buffer<ffi::S32> rows,
                    ffi::Buffer<ffi::S32> fresh, ffi::Buffer<ffi::F32> states, ffi::ResultBuffer<ffi::F32> o,
                    ffi::ResultBuffer<ffi::F32> states_out) {
  auto qd = q.dimensions(), vd = v.dimensions(), sd = states.dimensions();
  if (qd.size() != 3 || vd.size() != 3 || sd.size() != 4)
    return invalid("expected q, k [S, H, Dk], v [S, H, Dv], states [R, H, Dk, Dv]");
  Problem P{q.typed_data(), k.typed_data(), v.typed_data(), g.typed_data(), beta.typed_data(),
            rows.typed_data(), fresh.typed_data(), states_out->typed_data(), o->typed_data(),
            qd[0], sd[0], qd[1], qd[2], vd[2]};
  auto kd = k.dimensions();
  if (kd.size() != 3 || kd[0] != P.S || kd[1] != P.H || kd[2] != P.Dk || vd[0] != P.S || vd[1] != P.H ||
      sd[1] != P.H || sd[2] != P.Dk || sd[3] != P.Dv || g.element_count() != P.S * P.H ||
      beta.element_count() != P.S * P.H || rows.element_count() != P.S || fresh.element_count() != P.S)
    return invalid("the operands' shapes disagree");
  if (states_out->typed_data() != states.typed_data()) return invalid("the states must be aliased to the output");
  const int64_t items = P.S * P.H;
  if (items == 0) return ffi::Error::Success();
  // A head's update is 4 Dk Dv flops over 8 Dk Dv bytes: worth a helper from a few heads on.
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  const int64_t helpers = std::min<int64_t>(threads - 1, (items - 1) / 4);
  jaxllm_parallel::for_each_item(pool, items, std::max<int64_t>(helpers, 0),
                                 [P](int64_t i) { item(P, i / P.H, i % P.H); });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxllmGdnTokenF32, GdnToken,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()    // q [S, H, Dk] (normalised, scaled)
                                  .Arg<ffi::Buffer<ffi::F32>>()    // k [S, H, Dk] (normalised)
                                  .Arg<ffi::Buffer<ffi::F32>>()    // v [S, H, Dv]
                                  .Arg<ffi::Buffer<ffi::F32>>()    // g [S, H] (log decay)
                                  .Arg<ffi::Buffer<ffi::F32>>()    // beta [S, H]
                                  .Arg<ffi::Buffer<ffi::S32>>()    // rows [S]
                                  .Arg<ffi::Buffer<ffi::S32>>()    // fresh [S]
                                  .Arg<ffi::Buffer<ffi::F32>>()    // states [R, H, Dk, Dv]
                                  .Ret<ffi::Buffer<ffi::F32>>()    // o [S, H, Dv]
                                  .Ret<ffi::Buffer<ffi::F32>>());  // states, aliased
