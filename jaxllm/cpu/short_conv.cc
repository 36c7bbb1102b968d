// Native CPU causal short conv (Gated DeltaNet's depthwise conv of width K) over a ragged
// step's flat tokens for XLA, on the layer's conv state slots in place: the function of
// layers/short_conv.py's conv_prefill_ragged before its activation.  Sequence s's tokens
// x[start[s] .. start[s] + length[s]) read, K - 1 back, its state row (the K - 1 inputs
// before them); after the step the row holds its last K - 1 inputs.
//
// Why a kernel: in XLA every step gathered each sequence's state row out of the slots
// (mode "fill", element by element), built each tap's [T, C] window by gathers, and
// scattered the rows back: ~10 ms of a 64-sequence decode step of Qwen3.5's 8,192 channels,
// for a few hundred thousand multiply-adds.
// Called from jaxllm/cpu/native.py (conv_ragged) via XLA's FFI, the state array aliased in and out.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kBlock = 512;   // channels an item: a sequence's tokens over them

struct Problem {
  const float* x;                              // [T, C]
  const float* wt;                             // [K, C] (the weight transposed: taps outer)
  const int32_t *rows, *start, *length, *fresh;   // [S]
  float* states;                               // [R, K - 1, C]
  float* y;                                    // [T, C]
  int64_t T, C, K, S, R;
};

// Sequence s over channels [c0, c1): its outputs, then its state row.
void item(const Problem& P, int64_t s, int64_t c0, int64_t c1) {
  const int64_t C = P.C, K = P.K, n = P.length[s], a = P.start[s], r = P.rows[s];
  const bool has_row = r >= 0 && r < P.R;
  float* st = has_row ? P.states + r * (K - 1) * C : nullptr;
  const bool zeros = !has_row || P.fresh[s] != 0;   // a padding or fresh sequence starts from zeros
  // Input i of concat(state, x): rows 0 .. K - 2 the state, then the sequence's tokens
  // (null: a zero row).
  auto input = [&](int64_t i) -> const float* {
    if (i >= K - 1) return P.x + (a + i - (K - 1)) * C;
    return zeros ? nullptr : st + i * C;
  };
  for (int64_t i = 0; i < n; ++i) {
    float* yr = P.y + (a + i) * C;
    std::fill(yr + c0, yr + c1, 0.0f);
    for (int64_t j = 0; j < K; ++j) {   // taps in order, as the XLA form adds them
      const float* u = input(i + j);
      if (u == nullptr) continue;
      const float* w = P.wt + j * C;
      for (int64_t c = c0; c < c1; ++c) yr[c] += u[c] * w[c];
    }
  }
  if (!has_row) return;
  // Row q of the new state is input n + q: q ascending reads rows at or after those written.
  for (int64_t q = 0; q < K - 1; ++q) {
    const float* u = input(n + q);
    float* dst = st + q * C;
    if (u == nullptr)
      std::fill(dst + c0, dst + c1, 0.0f);
    else if (u != dst)
      std::memcpy(dst + c0, u + c0, (c1 - c0) * sizeof(float));
  }
}

ffi::Error invalid(const std::string& what) { return ffi::Error::InvalidArgument("jaxllm_conv_ragged_f32: " + what); }

ffi::Error ConvRagged(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> wt,
                      ffi::Buffer<ffi::S32> rows, ffi::Buffer<ffi::S32> start, ffi::Buffer<ffi::S32> length,
                      ffi::Buffer<ffi::S32> fresh, ffi::Buffer<ffi::F32> states, ffi::ResultBuffer<ffi::F32> y,
                      ffi::ResultBuffer<ffi::F32> states_out) {
  auto xd = x.dimensions(), wd = wt.dimensions(), sd = states.dimensions();
  if (xd.size() != 2 || wd.size() != 2 || sd.size() != 3)
    return invalid("expected x [T, C], wt [K, C], states [R, K - 1, C]");
  Problem P{x.typed_data(), wt.typed_data(), rows.typed_data(), start.typed_data(), length.typed_data(),
            fresh.typed_data(), states_out->typed_data(), y->typed_data(), xd[0], xd[1], wd[0],
            static_cast<int64_t>(rows.element_count()), sd[0]};
  if (wd[1] != P.C || sd[1] != P.K - 1 || sd[2] != P.C || P.K < 2 || start.element_count() != P.S ||
      length.element_count() != P.S || fresh.element_count() != P.S)
    return invalid("the operands' shapes disagree");
  if (states_out->typed_data() != states.typed_data()) return invalid("the states must be aliased to the output");
  // Tokens of no sequence (a padded step's tail) get zeros.
  std::vector<char> covered(P.T, 0);
  for (int64_t s = 0; s < P.S; ++s) {
    if (P.start[s] < 0 || P.length[s] < 0 || P.start[s] + P.length[s] > P.T)
      return invalid("a sequence's tokens run past the step's");
    std::fill(covered.begin() + P.start[s], covered.begin() + P.start[s] + P.length[s], 1);
  }
  for (int64_t t = 0; t < P.T; ++t)
    if (!covered[t]) std::memset(P.y + t * P.C, 0, P.C * sizeof(float));
  const int64_t blocks = (P.C + kBlock - 1) / kBlock, items = P.S * blocks;
  if (items == 0) return ffi::Error::Success();
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  const int64_t helpers = std::min<int64_t>(threads - 1, (items - 1) / 8);
  jaxllm_parallel::for_each_item(pool, items, std::max<int64_t>(helpers, 0), [P, blocks](int64_t i) {
    const int64_t b = i % blocks;
    item(P, i / blocks, b * kBlock, std::min(P.C, (b + 1) * kBlock));
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxllmConvRaggedF32, ConvRagged,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()    // x [T, C]
                                  .Arg<ffi::Buffer<ffi::F32>>()    // wt [K, C]
                                  .Arg<ffi::Buffer<ffi::S32>>()    // rows [S] (out of range: no state row)
                                  .Arg<ffi::Buffer<ffi::S32>>()    // start [S]
                                  .Arg<ffi::Buffer<ffi::S32>>()    // length [S]
                                  .Arg<ffi::Buffer<ffi::S32>>()    // fresh [S]
                                  .Arg<ffi::Buffer<ffi::F32>>()    // states [R, K - 1, C]
                                  .Ret<ffi::Buffer<ffi::F32>>()    // y [T, C], before the activation
                                  .Ret<ffi::Buffer<ffi::F32>>());  // states, aliased
