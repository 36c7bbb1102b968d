"""BERT's encoder forward over a flat ragged batch: word + absolute position + token-type
embeddings, LayerNorm, then post-LN blocks (self-attention, GELU MLP).

Attention is bidirectional within each prompt and never crosses prompts: every prompt of a
step is whole in that step (the pooling runner schedules it so), so a token attends over its
own sequence's tokens of this step and no K/V is kept afterwards.  It is plain XLA under a
same-sequence mask (the paged native CPU and Pallas kernels are causal and read K/V from
pages, which an encoder does not need).  A step of many prompts is block-diagonal, so a dense
``[H, T, T]`` score block would be mostly masked work (T = 4096 tokens of 32 prompts: 32x the
scores needed).  When the longest prompt ``max_len`` and the step's prompt rows are known, the
cheapest of three equal computations runs (chosen when the bucket is traced, by score count):
dense; per prompt (tokens moved into a ``[rows, max_len]`` grid, each row attending to itself:
prompts near ``max_len`` long); windowed (query tiles of ``TILE`` tokens, each against the key
window that can hold its prompts, ``TILE + 2 (max_len - 1)`` keys: many prompts much shorter
than ``max_len``).  The grid's rows and the windowed tiles are attended one after another
(``lax.map``: XLA:CPU runs one batched matmul over all of them several times slower), and q, k,
v come from one matmul (``prepare`` stacks their weights once).

A per-prompt step whose grid is no bigger than the step itself (prompts near ``max_len``, e.g.
32 prompts of 128 tokens in a 4096-token step) runs every layer, not only attention, in the grid:
groups of ``GROUP_TOKENS`` cells go through all the layers one group after another ("rows",
``_encode_rows``), a group's rows attended together, head-major (``_attend_rows``).  The same
sums per token; the point is the memory: a 4096-token step's
``[T, 1536]`` activations (24 MiB) fall out of the cores' caches between the dots, and XLA:CPU
fuses the whole block after attention into one YNNPACK graph at that size, which ran at about
two thirds of the per-token rate of the same dots on 128 or 512 rows (profile in
docs/BENCHMARKS.md ``## Embeddings``).  Other steps longer than ``GROUP_TOKENS`` run the
token-by-token part of each layer after attention in pieces of that size for the same reason.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.models.bert.config import encoder
from jaxllm.models.config import ArchConfig


def _layer_norm(x, w, b, eps: float):
    """x [T, D] float32 -> [T, D]; torch's LayerNorm (biased variance)."""
    mean = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + eps) * w + b


def _linear(x, w, b):
    """x [T, in] @ w [out, in]^T + b [out], float32 accumulation."""
    y = jax.lax.dot_general(x, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    return y + b


def _gelu(x, tanh: bool):
    """GELU; exact (``tanh`` False) as torch computes it on a CPU, ``x (1 + erf(x / sqrt 2)) / 2``:
    XLA's float32 erf is one rational polynomial, where ``jax.nn.gelu``'s ``erfc`` adds an
    exponential branch (measured on two cores: [128, 1536] 0.28 ms against 0.11 ms)."""
    if tanh:
        return jax.nn.gelu(x, approximate=True)
    return x * (0.5 + 0.5 * jax.lax.erf(x * np.float32(0.7071067811865476)))


TILE = 128
"""Query tokens per tile of the windowed attention."""


def _each(fn, xs):
    """``fn`` over the leading axis of the arrays ``xs``, one slice after another (``lax.map``):
    XLA:CPU runs a batch of small attention matmuls many times slower than the same matmuls one
    slice at a time (measured on two cores: 32 prompts of 128 tokens, 12 heads, 167 ms batched
    against 24 ms in a loop)."""
    return jax.lax.map(fn, xs)


def _attend(q, k, v, mask):
    """q [Lq, H, Dh] (scaled), k, v [Lk, H, Dh]; mask [Lq or 1, Lk] bool (the keys each query
    sees) -> [Lq, H, Dh].  The softmax's division waits for the output (``[Lq, H, Dh]`` divisions
    instead of ``[H, Lq, Lk]``).  A query that sees no key (an empty grid row) averages every
    value: finite, and unused."""
    scores = jnp.einsum("qhd,khd->hqk", q, k, preferred_element_type=jnp.float32)          # [H, Lq, Lk]
    scores = jnp.where(mask[None], scores, -1e30)
    p = jnp.exp(scores - jnp.max(scores, axis=-1, keepdims=True))                          # [H, Lq, Lk]
    out = jnp.einsum("hqk,khd->qhd", p, v, preferred_element_type=jnp.float32)             # [Lq, H, Dh]
    return out / jnp.transpose(jnp.sum(p, axis=-1))[:, :, None]


def _attend_rows(q, k, v, valid):
    """q [g, L, H, Dh] (scaled), k, v [g, L, H, Dh]; valid [g, 1, L] bool (each row's tokens) ->
    [g, L, H, Dh]: each of g grid rows attending within itself, all g rows and H heads as one
    batched matmul over head-major copies (``[g, H, L, Dh]``).  The rows layout's attention: with
    the transposes written out XLA:CPU fuses the softmax's exponential into the value matmul and
    needs fewer copies than ``_attend`` one row at a time (``lax.map``), which transposes each
    row's q, k, v and output in separate ops (profile in docs/BENCHMARKS.md ``## Embeddings``)."""
    q, k, v = (jnp.transpose(a, (0, 2, 1, 3)) for a in (q, k, v))                          # [g, H, L, Dh]
    scores = jnp.einsum("ghqd,ghkd->ghqk", q, k, preferred_element_type=jnp.float32)         # [g, H, L, L]
    scores = jnp.where(valid[:, None], scores, -1e30)
    p = jnp.exp(scores - jnp.max(scores, axis=-1, keepdims=True))                            # [g, H, L, L]
    out = jnp.einsum("ghqk,ghkd->ghqd", p, v, preferred_element_type=jnp.float32)            # [g, H, L, Dh]
    return jnp.transpose(out / jnp.sum(p, axis=-1)[..., None], (0, 2, 1, 3))                 # [g, L, H, Dh]


def _dense(q, k, v, seq_ids):
    """q, k, v [T, H, Dh] (q scaled); seq_ids [T] -> [T, H, Dh]: each query over its prompt's keys."""
    return _attend(q, k, v, seq_ids[:, None] == seq_ids[None, :])                          # mask [T, T]


def _windowed(q, k, v, seq_ids, max_len: int):
    """The same as ``_dense`` for prompts of at most ``max_len`` tokens laid side by side: query
    tile n (tokens ``[n TILE, (n+1) TILE)``) sees keys ``[n TILE - (max_len-1), (n+1) TILE + max_len - 1)``
    at most, so it scores a window of W keys starting there (moved inside the step at its ends)."""
    T, H, Dh = q.shape
    n = -(-T // TILE)
    Tp = n * TILE
    W = min(Tp, TILE + 2 * (max_len - 1))
    pad = Tp - T
    q, k, v = (jnp.pad(a, ((0, pad), (0, 0), (0, 0))) for a in (q, k, v))                  # [Tp, H, Dh]
    seq = jnp.pad(seq_ids, (0, pad), constant_values=-1)                                   # [Tp]
    starts = jnp.clip(jnp.arange(n) * TILE - (max_len - 1), 0, Tp - W)                     # [n]
    window = jnp.arange(W)[None, :] + starts[:, None]                                      # [n, W]
    kw, vw, sw = k[window], v[window], seq[window]                                         # [n, W, H, Dh], [n, W]
    qt, st = q.reshape(n, TILE, H, Dh), seq.reshape(n, TILE)
    mask = st[:, :, None] == sw[:, None, :]        # [n, TILE, W]; a query's own token is in its window
    out = _each(lambda a: _attend(*a), (qt, kw, vw, mask))                                 # [n, TILE, H, Dh]
    return out.reshape(Tp, H, Dh)[:T]


def _per_prompt(q, k, v, seq_ids, positions, rows: int, max_len: int):
    """The same as ``_dense`` with each prompt (``seq_ids`` < ``rows``, ``positions`` < ``max_len``)
    moved into a row of a ``[rows, max_len]`` grid and attending within it; padding tokens
    (``seq_ids`` -1) answer zeros."""
    T, H, Dh = q.shape
    slot, cells = _grid_slot(seq_ids, positions, rows, max_len), rows * max_len          # [T]
    grid = [_into_grid(a, slot, cells).reshape(rows, max_len, H, Dh) for a in (q, k, v)]   # [rows, L, H, Dh]
    valid = _into_grid(jnp.ones(T, bool), slot, cells).reshape(rows, 1, max_len)           # [rows, 1, L]
    out = _each(lambda a: _attend(*a), (*grid, valid)).reshape(cells, H, Dh)              # [rows L, H, Dh]
    return _out_of_grid(out, seq_ids, slot)                                                # [T, H, Dh]


def _grid_slot(seq_ids, positions, rows: int, max_len: int):
    """[T] each token's cell in a ``[rows, max_len]`` grid (prompt ``seq_ids`` in its row, at its
    position); padding tokens (``seq_ids`` -1) the spare cell ``rows * max_len``."""
    return jnp.where(seq_ids >= 0, seq_ids * max_len + positions, rows * max_len)


def _into_grid(a, slot, cells: int):
    """a [T, ...] -> [cells, ...]: each token's row at its cell, zeros in the cells no token holds."""
    return jnp.zeros((cells + 1,) + a.shape[1:], a.dtype).at[slot].set(a)[:cells]


def _out_of_grid(out, seq_ids, slot):
    """out [cells, ...] -> [T, ...]: each token's cell back; padding tokens zeros."""
    keep = (seq_ids >= 0).reshape((-1,) + (1,) * (out.ndim - 1))
    return jnp.where(keep, out[jnp.minimum(slot, out.shape[0] - 1)], 0.0)


# Relative cost per score of the windowed layout (its gathers and masks), measured on a CPU.
WINDOW_COST = 3


def _after_attention(lp: dict, x, a, eps: float, gelu_tanh: bool):
    """x [N, D] (the layer's input), a [N, D] (attention's output before ``o``) -> [N, D]: the
    output projection, residual, LayerNorm, GELU MLP, residual, LayerNorm (token by token)."""
    x = _layer_norm(x + _linear(a, lp["o"], lp["o_bias"]), lp["attn_norm"], lp["attn_norm_bias"], eps)
    h = _gelu(_linear(x, lp["up"], lp["up_bias"]), gelu_tanh)                              # [N, F]
    return _layer_norm(x + _linear(h, lp["down"], lp["down_bias"]), lp["mlp_norm"], lp["mlp_norm_bias"], eps)


def _layer(arch: ArchConfig, lp: dict, x, attend, eps: float, gelu_tanh: bool, chunk: int | None = None):
    """One post-LN block: x [N, D] -> [N, D]; ``attend(q, k, v)`` [N, H, Dh] (q scaled) -> [N, H, Dh]
    says which queries see which keys.  ``chunk``: the token-by-token part after attention runs
    ``chunk`` rows at a time (``lax.map``; when it divides N and is smaller) so its ``[chunk, F]``
    activations stay in cache (``GROUP_TOKENS`` says why)."""
    N, D = x.shape
    H, Dh = arch.num_heads, arch.head_dim
    qkv = _linear(x, lp["qkv"], lp["qkv_bias"]).reshape(N, 3, H, Dh)                     # [N, 3, H, Dh]
    q, k, v = qkv[:, 0] * (Dh ** -0.5), qkv[:, 1], qkv[:, 2]
    a = attend(q, k, v).reshape(N, H * Dh)                                                # [N, D]
    if chunk is None or N <= chunk or N % chunk:
        return _after_attention(lp, x, a, eps, gelu_tanh)
    pieces = (x.reshape(N // chunk, chunk, D), a.reshape(N // chunk, chunk, D))           # [N / chunk, chunk, D]
    return _each(lambda t: _after_attention(lp, *t, eps, gelu_tanh), pieces).reshape(N, D)


def _flat_attend(layout: str, seq_ids, positions, rows: int | None, max_len: int | None):
    """``attend`` for ``_layer`` over the whole flat step in ``layout`` (dense, per_prompt, windowed)."""
    if layout == "per_prompt":
        return lambda q, k, v: _per_prompt(q, k, v, seq_ids, positions, rows, max_len)
    if layout == "windowed":
        return lambda q, k, v: _windowed(q, k, v, seq_ids, max_len)
    return lambda q, k, v: _dense(q, k, v, seq_ids)


GROUP_TOKENS = 512
"""Grid cells the rows layout runs through the encoder at once (``group_rows``), and the rows of
a longer flat step's pieces after attention (``_layer``'s ``chunk``): at this size a
layer's activations ([512, 1536] float32, 3 MiB) stay near the cores between its dots, where a
4096-token step's ([4096, 1536], 24 MiB) do not (measured on two cores: a 32 x 128-token step
1.2-1.4x the CPU time per prompt of 8 groups of 4 prompts)."""


def group_rows(rows: int, max_len: int) -> int:
    """Grid rows per group of the rows layout: the most that divide ``rows`` within ``GROUP_TOKENS``
    cells (at least one)."""
    return max([g for g in range(1, rows + 1) if rows % g == 0 and g * max_len <= GROUP_TOKENS] or [1])


def _encode_rows(arch: ArchConfig, layers: list, x, seq_ids, positions, rows: int, max_len: int, eps: float,
                 gelu_tanh: bool):
    """The encoder's layers with each prompt in a row of a ``[rows, max_len]`` grid: groups of
    ``group_rows`` rows go through every layer one group after another (``lax.map``), each row
    attending within itself (``_attend_rows``: the group's rows at once).  x [T, D] (embedded) ->
    [T, D]; padding tokens (``seq_ids`` -1) answer zeros.  Equal to the flat layers under the same-prompt mask; cheaper when the grid is
    no bigger than the step (``encoder_layout``)."""
    T, D = x.shape
    H, Dh = arch.num_heads, arch.head_dim
    cells, g = rows * max_len, group_rows(rows, max_len)
    slot = _grid_slot(seq_ids, positions, rows, max_len)                                   # [T]
    grid = _into_grid(x, slot, cells).reshape(rows // g, g * max_len, D)                   # [rows / g, g L, D]
    valid = _into_grid(jnp.ones(T, bool), slot, cells).reshape(rows // g, g, 1, max_len)   # [rows / g, g, 1, L]

    def group(args):
        xg, vg = args                                                   # [g L, D], [g, 1, L]

        def attend(q, k, v):                                            # [g L, H, Dh] each
            q, k, v = (a.reshape(g, max_len, H, Dh) for a in (q, k, v))
            return _attend_rows(q, k, v, vg).reshape(g * max_len, H, Dh)
        for lp in layers:
            xg = _layer(arch, lp, xg, attend, eps, gelu_tanh)
        return xg

    out = _each(group, (grid, valid)).reshape(cells, D)                                  # [rows L, D]
    return _out_of_grid(out, seq_ids, slot)                                                # [T, D]


def encoder_layout(T: int, rows: int | None, max_len: int | None) -> str:
    """How a step runs: ``attention_layout``'s choice, except that a per-prompt step whose
    ``[rows, max_len]`` grid holds no more cells than the step's ``T`` tokens runs whole layers
    in the grid ("rows": ``_encode_rows``)."""
    layout = attention_layout(T, rows, max_len)
    if layout == "per_prompt" and rows * max_len <= T:
        return "rows"
    return layout


def attention_layout(T: int, rows: int | None, max_len: int | None) -> str:
    """Which equal computation a step of ``T`` tokens in ``rows`` prompts of at most ``max_len``
    tokens runs: the fewest scores (static: one choice per bucket)."""
    if max_len is None or rows is None:
        return "dense"
    cost = {"dense": T * T, "per_prompt": rows * max_len * max_len}
    if T > TILE + 2 * (max_len - 1):
        cost["windowed"] = WINDOW_COST * T * (TILE + 2 * (max_len - 1))
    return min(cost, key=cost.get)


def prepare(params: dict) -> dict:
    """The loaded weights as ``encode`` reads them (the runner calls it once, on the host): each
    layer's ``q``, ``k``, ``v`` [D, D] stacked into ``qkv`` [3D, D] (their biases into
    ``qkv_bias`` [3D]), one matmul instead of three (XLA:CPU runs the one faster)."""
    layers = []
    for lp in params["layers"]:
        lp = dict(lp)
        lp["qkv"] = np.concatenate([np.asarray(lp.pop(n)) for n in ("q", "k", "v")])
        lp["qkv_bias"] = np.concatenate([np.asarray(lp.pop(n)) for n in ("q_bias", "k_bias", "v_bias")])
        layers.append(lp)
    return {**params, "layers": layers}


def encode(arch: ArchConfig, params: dict, input_ids, positions, seq_ids, token_types, max_len: int | None = None,
           rows: int | None = None):
    """The encoder's last hidden states.

    input_ids [T] int32, positions [T] int32 (each token's index in its prompt), seq_ids [T]
    int32 (the prompt each token belongs to; padding tokens carry their own id, -1),
    token_types [T] int32 (0 for a single text; a pair's second text 1) -> hidden [T, D]
    float32.  ``params``: ``{"globals": {...}, "layers": [{...}, ...]}`` as ``prepare`` returns them; ``max_len`` (static): no
    prompt is longer, ``rows`` (static): prompt rows of the step (seq ids below it); with both the
    attention may run per prompt or windowed, or the whole layers in grid rows
    (``encoder_layout``), else dense.  Padding tokens' rows are not meaningful (zeros in the rows
    layout)."""
    enc = encoder(arch)
    g = params["globals"]
    x = (g["embed"][input_ids] + g["pos_embed"][positions + enc.position_offset]
         + g["type_embed"][token_types])                                     # [T, D]
    x = _layer_norm(x.astype(jnp.float32), g["embed_norm"], g["embed_norm_bias"], enc.layer_norm_eps)
    layout = encoder_layout(input_ids.shape[0], rows, max_len)
    if layout == "rows":
        return _encode_rows(arch, params["layers"], x, seq_ids, positions, rows, max_len, enc.layer_norm_eps,
                            enc.gelu_tanh)
    attend = _flat_attend(layout, seq_ids, positions, rows, max_len)
    for lp in params["layers"]:
        x = _layer(arch, lp, x, attend, enc.layer_norm_eps, enc.gelu_tanh, GROUP_TOKENS)
    return x


def classify(arch: ArchConfig, params: dict, hidden, seq_ids, query_start_loc):
    """A cross-encoder's head: hidden [T, D], seq_ids [T], query_start_loc [S+1] (the runner's
    step layout) -> logits [S, num_labels], from each prompt's first token (``[CLS]`` / ``<s>``):
    BERT's ``classifier(tanh(pooler(.)))``, the same sum as RoBERTa's
    ``out_proj(tanh(dense(.)))`` (``params.py`` maps either's names)."""
    g = params["globals"]
    first = hidden[query_start_loc[:-1]]                                   # [S, D]
    pooled = jnp.tanh(_linear(first, g["pooler"], g["pooler_bias"]))
    return _linear(pooled, g["classifier"], g["classifier_bias"])
