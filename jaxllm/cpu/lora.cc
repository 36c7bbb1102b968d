// Native CPU LoRA shrink and expand for XLA (punica's sgmv on the CPU), float32: each token
// multiplied by its own slot's matrices only, read in place from the slot arrays.  One call,
// jaxllm_lora_add_f32, does the shrink of one A (q/k/v's side by side, or one projection's)
// and then the expand of each of its projections:
//
//   shrink: xa[t, p*R:p*R+r] = A[slot[t], layer][p*R:p*R+r, :] @ x[t, :] for each part p of C
//           (one projection's R = `part` rows), r = ranks[slot[t]]; xa's other columns 0
//           A [S, L, C, in] (transposed: its rows past the rank, zero padding, are not read), xa [T, C]
//   expand: y[t, col:col+O] += xa[t, r0:r0+r] @ B[slot[t], layer][:r]   B [S, L, R, O], y aliased,
//           r = ranks[slot[t]] (the rows past it are zero padding: not read), per projection
//
// A token whose slot is out of [0, S) (-1: the base model, or bucket padding) gets xa = 0 and
// leaves y as it is.  Why a kernel (jaxllm/lora/apply.py): in XLA a mixed batch needs either
// every slot's dot over every token (masked: the work grows with the adapters in the batch)
// or a loop over the used slots, whose dynamic slices of the slot arrays are copies, and
// whose many small ops (adds, selects, slices per slot and projection) cost more than their
// arithmetic at a decode step.  Here the tokens are grouped by slot (a counting sort) and
// cut into blocks of up to kBlock tokens of one slot; a block reads its slot's rows once for
// all its tokens.  A step with no adapter returns at once (y is aliased: nothing is copied).
// The expand sums a token's delta over the rank first, then adds it to y: the function of
// (y + (xa @ B)) in float32, as apply.py's XLA path computes it.  The shrink's dot products
// run in a fixed order of their own (dot_tile says which).
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cmath>
#include <cstring>
#include <vector>

#include "parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kBlock = 8;    // tokens of one slot that share one read of its rows

struct Block {
  int64_t slot, begin, end;      // tokens order[begin:end], all of `slot`
};

// Tokens grouped by slot (stable), cut into blocks; `order` gets the token indices.
std::vector<Block> blocks_by_slot(const int32_t* slots, int64_t T, int64_t S, std::vector<int64_t>& order) {
  std::vector<int64_t> count(S + 1, 0);
  for (int64_t t = 0; t < T; ++t)
    if (slots[t] >= 0 && slots[t] < S) ++count[slots[t] + 1];
  for (int64_t s = 0; s < S; ++s) count[s + 1] += count[s];
  order.assign(count[S], 0);
  std::vector<int64_t> next(count.begin(), count.end() - 1);
  for (int64_t t = 0; t < T; ++t)
    if (slots[t] >= 0 && slots[t] < S) order[next[slots[t]]++] = t;
  std::vector<Block> out;
  for (int64_t s = 0; s < S; ++s)
    for (int64_t b = count[s]; b < count[s + 1]; b += kBlock) out.push_back({s, b, std::min(b + kBlock, count[s + 1])});
  return out;
}

// Runs body(block) over the pool: the calling thread and up to threads - 1 tasks (linear.cc's rule).
template <typename Body>
void run_blocks(ffi::ThreadPool& pool, const std::vector<Block>& blocks, Body body) {
  const int64_t n = static_cast<int64_t>(blocks.size());
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  const int64_t tasks = std::min<int64_t>(threads - 1, n - 1);
  if (tasks <= 0) {
    for (const Block& b : blocks) body(b);
    return;
  }
  const Block* bp = blocks.data();
  jaxllm_parallel::for_each_item(pool, n, tasks, [=](int64_t i) { body(bp[i]); });
}

// out[t][c0 + c] (+)= sum_k xr[t][k] * w[k * ldw + c0 + c] for TT tokens and 8 * NV columns, the
// TT x NV accumulators in registers; k ascending (one FMA per k): the same order for any tile.
// The expand's tile: its K is a rank (8-16), a short chain.
template <int TT, int NV, bool kAdd>
inline void tile(const float* const* xr, const float* w, int64_t K, int64_t ldw, int64_t c0, float* const* out) {
  __m256 acc[TT][NV];
  for (int t = 0; t < TT; ++t)
    for (int v = 0; v < NV; ++v) acc[t][v] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    __m256 a[NV];
    for (int v = 0; v < NV; ++v) a[v] = _mm256_loadu_ps(w + k * ldw + c0 + 8 * v);
    for (int t = 0; t < TT; ++t) {
      const __m256 xv = _mm256_set1_ps(xr[t][k]);
      for (int v = 0; v < NV; ++v) acc[t][v] = _mm256_fmadd_ps(xv, a[v], acc[t][v]);
    }
  }
  for (int t = 0; t < TT; ++t)
    for (int v = 0; v < NV; ++v) {
      float* o = out[t] + c0 + 8 * v;
      _mm256_storeu_ps(o, kAdd ? _mm256_add_ps(_mm256_loadu_ps(o), acc[t][v]) : acc[t][v]);
    }
}

// The columns [0, ncols) of TT tokens: tiles of 8 * NV, then of 8, then one at a time.
template <int TT, int NV, bool kAdd>
void tokens(const float* const* xr, const float* w, int64_t K, int64_t ldw, int64_t ncols, float* const* out) {
  int64_t c0 = 0;
  for (; c0 + 8 * NV <= ncols; c0 += 8 * NV) tile<TT, NV, kAdd>(xr, w, K, ldw, c0, out);
  for (; c0 + 8 <= ncols; c0 += 8) tile<TT, 1, kAdd>(xr, w, K, ldw, c0, out);
  for (; c0 < ncols; ++c0)
    for (int t = 0; t < TT; ++t) {
      float s = 0.0f;
      for (int64_t k = 0; k < K; ++k) s = std::fma(xr[t][k], w[k * ldw + c0], s);
      out[t][c0] = kAdd ? out[t][c0] + s : s;
    }
}

// Calls body(n, xr, out) for the block's tokens n <= 3 at a time, in order: xr[j] = x + order[i +
// j] * ldx and out[j] = o + order[i + j] * ldo, the rows of token j of the n.
template <typename Body>
void by_threes(const Block& b, const int64_t* order, const float* x, int64_t ldx, float* o, int64_t ldo, Body body) {
  for (int64_t i = b.begin; i < b.end;) {
    const float* xr[3];
    float* out[3];
    const int64_t n = std::min<int64_t>(3, b.end - i);
    for (int64_t j = 0; j < n; ++j) {
      xr[j] = x + order[i + j] * ldx;
      out[j] = o + order[i + j] * ldo;
    }
    body(n, xr, out);
    i += n;
  }
}

// For each token i of the block: out_i[0:ncols] += x_i[0:K] @ w [K, ldw] (its first ncols
// columns), x_i = x + order[i] * ldx, out_i = o + order[i] * ldo; tokens three at a time
// (one alone: 64 columns a tile, eight accumulator chains side by side).
void expand_block(const Block& b, const int64_t* order, const float* x, int64_t ldx, const float* w, int64_t K,
                  int64_t ldw, int64_t ncols, float* o, int64_t ldo) {
  by_threes(b, order, x, ldx, o, ldo, [&](int64_t n, const float* const* xr, float* const* out) {
    if (n == 3) tokens<3, 4, true>(xr, w, K, ldw, ncols, out);
    else if (n == 2) tokens<2, 4, true>(xr, w, K, ldw, ncols, out);
    else tokens<1, 8, true>(xr, w, K, ldw, ncols, out);
  });
}

// The shrink reads A transposed, A_T [C, in]: each of xa's columns is a dot product of a token's x
// with one contiguous row of A_T, so a part reads its `rank` rows and nothing of the padding
// (a rank-8 adapter in rank-16 slots: half the bytes).  A dot product runs in 8 lanes over k
// (lane l: the k = l (mod 8) of each 8-chunk) with two chains (even and odd chunks, so that
// the FMAs of a few rows keep the pipes busy), a last partial chunk read with its lanes past
// K as zeros; the chains are added, then the lanes in one fixed tree.  The operations and
// their order do not depend on the tile or on the tokens sharing the step: a token's xa is
// the same bits whatever else runs with it.
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// out[t][c] = x_t . w_c for TT tokens and NR rows c of A_T (w_c = w + c * K).
template <int TT, int NR>
inline void dot_tile(const float* const* xr, const float* w, int64_t K, const int64_t* rows, __m256i tail,
                     float* const* out) {
  __m256 acc[2][TT][NR];
  for (int j = 0; j < 2; ++j)
    for (int t = 0; t < TT; ++t)
      for (int r = 0; r < NR; ++r) acc[j][t][r] = _mm256_setzero_ps();
  auto chunk = [&](int64_t k, int j, bool masked) {
    __m256 xv[TT];
    for (int t = 0; t < TT; ++t) xv[t] = masked ? _mm256_maskload_ps(xr[t] + k, tail) : _mm256_loadu_ps(xr[t] + k);
    for (int r = 0; r < NR; ++r) {
      const float* p = w + rows[r] * K + k;
      const __m256 a = masked ? _mm256_maskload_ps(p, tail) : _mm256_loadu_ps(p);
      for (int t = 0; t < TT; ++t) acc[j][t][r] = _mm256_fmadd_ps(xv[t], a, acc[j][t][r]);
    }
  };
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {
    chunk(k, 0, false);
    chunk(k + 8, 1, false);
  }
  if (k + 8 <= K) {
    chunk(k, 0, false);
    k += 8;
    if (k < K) chunk(k, 1, true);
  } else if (k < K) {
    chunk(k, 0, true);
  }
  for (int t = 0; t < TT; ++t)
    for (int r = 0; r < NR; ++r) out[t][rows[r]] = hsum(_mm256_add_ps(acc[0][t][r], acc[1][t][r]));
}

// The shrink of a block: for each token, xa[c] for c in each part's [p * R, p * R + rank) (the
// columns past the slot's rank stay 0: A's padding there is not read); tokens three at a time.
void shrink_block(const Block& b, const int64_t* order, const float* x, int64_t K, const float* a, int64_t C,
                  int64_t R, int64_t rank, float* xa) {
  std::vector<int64_t> rows;
  for (int64_t c = 0; c < C; c += R)
    for (int64_t i = 0; i < rank; ++i) rows.push_back(c + i);
  const int64_t n_rows = static_cast<int64_t>(rows.size());
  const int64_t rem = K % 8;
  const __m256i tail = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(rem)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  by_threes(b, order, x, K, xa, C, [&](int64_t n, const float* const* xr, float* const* out) {
    int64_t r = 0;
    if (n == 1) {
      for (; r + 4 <= n_rows; r += 4) dot_tile<1, 4>(xr, a, K, rows.data() + r, tail, out);
      for (; r < n_rows; ++r) dot_tile<1, 1>(xr, a, K, rows.data() + r, tail, out);
    } else if (n == 2) {
      for (; r + 2 <= n_rows; r += 2) dot_tile<2, 2>(xr, a, K, rows.data() + r, tail, out);
      for (; r < n_rows; ++r) dot_tile<2, 1>(xr, a, K, rows.data() + r, tail, out);
    } else {
      for (; r + 2 <= n_rows; r += 2) dot_tile<3, 2>(xr, a, K, rows.data() + r, tail, out);
      for (; r < n_rows; ++r) dot_tile<3, 1>(xr, a, K, rows.data() + r, tail, out);
    }
  });
}

int64_t layer_of(const ffi::Buffer<ffi::S32>& layer) { return static_cast<int64_t>(layer.typed_data()[0]); }

// Whether a token has a slot in [0, S): a step without one returns before any allocation.
bool any_slot(const int32_t* slots, int64_t T, int64_t S) {
  for (int64_t t = 0; t < T; ++t)
    if (slots[t] >= 0 && slots[t] < S) return true;
  return false;
}

// The deltas of the projections of one input (one A: q/k/v side by side, or one projection
// alone) added into their outputs, in one call: each block of a slot's tokens is shrunk into
// xa, then expanded into every projection's columns, so a step pays one call per A (not one
// per shrink and per expand) and one spread over the pool.
//   B_j [S, L, R, O_j] (R = part): the rows r0s[j] ... r0s[j] + R of xa (this projection's part),
//   added into ys[outs[j]][:, cols[j] : cols[j] + O_j]; ys [T, N_i] aliased to the results.
ffi::Error Add(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> a, ffi::Buffer<ffi::S32> slots,
               ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> ranks, ffi::RemainingArgs rest,
               ffi::Span<const int64_t> cols, ffi::Span<const int64_t> outs, int64_t part,
               ffi::Span<const int64_t> r0s, ffi::RemainingRets results) {
  constexpr const char* kShapes =
      "jaxllm_lora_add_f32: expected x [T, in], A [S, L, C, in] (C a multiple of part), slots [T], ranks [S], "
      "then B_j [S, L, part, O_j] and ys [T, N_i], as many results as ys, cols/outs/r0s one per B, "
      "r0 + part <= C, col + O_j <= N_out";
  auto xd = x.dimensions();
  auto ad = a.dimensions();
  const int64_t nb = static_cast<int64_t>(outs.size());
  const int64_t ny = static_cast<int64_t>(rest.size()) - nb;
  if (xd.size() != 2 || ad.size() != 4 || ad[3] != xd[1] || slots.dimensions().size() != 1 ||
      slots.dimensions()[0] != xd[0] || ranks.dimensions().size() != 1 || ranks.dimensions()[0] != ad[0] ||
      part <= 0 || ad[2] % part != 0 || ny <= 0 || static_cast<int64_t>(results.size()) != ny ||
      static_cast<int64_t>(cols.size()) != nb || static_cast<int64_t>(r0s.size()) != nb)
    return ffi::Error::InvalidArgument(kShapes);
  const int64_t T = xd[0], K = xd[1], S = ad[0], L = ad[1], C = ad[2], l = layer_of(layer);
  if (l < 0 || l >= L) return ffi::Error::InvalidArgument("jaxllm_lora_add_f32: layer out of range");
  std::vector<float*> y(ny);
  std::vector<int64_t> width(ny);
  for (int64_t i = 0; i < ny; ++i) {
    auto in = rest.get<ffi::Buffer<ffi::F32>>(nb + i);
    auto out = results.get<ffi::Buffer<ffi::F32>>(i);
    if (!in.has_value() || !out.has_value()) return ffi::Error::InvalidArgument(kShapes);
    auto yd = in->dimensions();
    if (yd.size() != 2 || yd[0] != T || (*out)->dimensions().size() != 2 || (*out)->dimensions()[1] != yd[1])
      return ffi::Error::InvalidArgument(kShapes);
    y[i] = (*out)->typed_data();
    width[i] = yd[1];
    if (y[i] != in->typed_data()) std::memcpy(y[i], in->typed_data(), sizeof(float) * T * yd[1]);   // not aliased
  }
  std::vector<const float*> bw(nb);
  std::vector<int64_t> bo(nb);
  for (int64_t j = 0; j < nb; ++j) {
    auto b = rest.get<ffi::Buffer<ffi::F32>>(j);
    if (!b.has_value()) return ffi::Error::InvalidArgument(kShapes);
    auto bd = b->dimensions();
    if (bd.size() != 4 || bd[0] != S || bd[1] != L || bd[2] != part || outs[j] < 0 || outs[j] >= ny ||
        r0s[j] < 0 || r0s[j] + part > C || cols[j] < 0 || cols[j] + bd[3] > width[outs[j]])
      return ffi::Error::InvalidArgument(kShapes);
    bw[j] = b->typed_data();
    bo[j] = bd[3];
  }
  if (!any_slot(slots.typed_data(), T, S)) return ffi::Error::Success();
  const float* xp = x.typed_data();
  const float* ap = a.typed_data();
  const int32_t* rp = ranks.typed_data();
  std::vector<float> xa(T * C, 0.0f);                  // [T, C]: only the blocks' tokens are written
  std::vector<int64_t> order;
  const std::vector<Block> blocks = blocks_by_slot(slots.typed_data(), T, S, order);
  const int64_t* op = order.data();
  run_blocks(pool, blocks, [&](const Block& b) {
    const int64_t rank = std::max<int64_t>(0, std::min<int64_t>(part, rp[b.slot]));
    shrink_block(b, op, xp, K, ap + (b.slot * L + l) * C * K, C, part, rank, xa.data());   // A_T [C, in]
    // ys[outs[j]][t, col:col+O] += xa[t, r0:r0+rank] @ B_j[:rank]: the delta summed over the
    // rank in registers, then added (B's rows past the rank, the padding of a smaller adapter
    // in larger slots, are not read).
    for (int64_t j = 0; j < nb; ++j)
      expand_block(b, op, xa.data() + r0s[j], C, bw[j] + (b.slot * L + l) * part * bo[j], rank, bo[j], bo[j],
                   y[outs[j]] + cols[j], width[outs[j]]);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxllmLoraAddF32, Add,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // x [T, in]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // A [S, L, C, in] (transposed)
                                  .Arg<ffi::Buffer<ffi::S32>>()   // slots [T]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // layer []
                                  .Arg<ffi::Buffer<ffi::S32>>()   // ranks [S]: each slot's adapter's rank
                                  .RemainingArgs()                // B_j [S, L, part, O_j], then ys [T, N_i] (aliased)
                                  .Attr<ffi::Span<const int64_t>>("cols")   // ys' first column of each B's projection
                                  .Attr<ffi::Span<const int64_t>>("outs")   // the y each B adds into
                                  .Attr<int64_t>("part")                    // rows of one projection's A (R)
                                  .Attr<ffi::Span<const int64_t>>("r0s")    // xa's first column of each B's part
                                  .RemainingRets());              // ys
