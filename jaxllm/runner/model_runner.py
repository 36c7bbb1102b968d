"""ModelRunner: the only component that touches device arrays.

It keeps per-request host state keyed by request id (tokens, block table, sampling
parameters), turns each ``SchedulerOutput`` into padded numpy arrays, picks the compiled
step of the (T, S) bucket, runs it with the KV cache donated, and returns the sampled
tokens as plain Python lists.  Every bucket is compiled at start-up from
``ShapeDtypeStruct``s; afterwards a step that traces or compiles is a bug, reported by the
compile guard (fatal in tests).
"""

from __future__ import annotations

import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.errors import CompileGuardError
from jaxllm.layers.attention import AttentionMetadata
from jaxllm.models.loader import LoadedModel
from jaxllm.models.registry import get_model_module
from jaxllm.outputs import EMPTY_RUNNER_OUTPUT, NewRequestData, RunnerOutput, SampleLogprobs, SchedulerOutput
from jaxllm.runner import buckets as bk
from jaxllm.runner import compile as cc
from jaxllm.runner.step import StepInputs, make_step
from jaxllm.sample.gumbel import split_seed
from jaxllm.sample.sampler import SamplingMetadata

log = logging.getLogger("jaxllm.runner")


@dataclass
class _ReqState:
    token_ids: list[int]
    num_prompt_tokens: int
    block_ids: list[int]
    num_computed_tokens: int
    temperature: float
    top_k: int
    top_p: float
    min_p: float
    seed_lo: int
    seed_hi: int
    num_logprobs: int

    @classmethod
    def from_new(cls, nr: NewRequestData) -> "_ReqState":
        sp = nr.sampling_params
        lo, hi = split_seed(nr.seed)
        return cls(token_ids=list(nr.token_ids), num_prompt_tokens=nr.num_prompt_tokens,
                   block_ids=list(nr.block_ids), num_computed_tokens=nr.num_computed_tokens,
                   temperature=0.0 if sp.greedy else float(sp.temperature), top_k=int(sp.top_k),
                   top_p=float(sp.top_p), min_p=float(sp.min_p), seed_lo=lo, seed_hi=hi,
                   num_logprobs=-1 if sp.logprobs is None else int(sp.logprobs))


def _to_device_params(model: LoadedModel, dtype, scan_layers: bool) -> dict:
    np_dtype = jnp.dtype(dtype)

    def conv(a):
        return jax.device_put(np.asarray(a, dtype=np_dtype))

    params = {k: conv(v) for k, v in model.globals.items()}
    if scan_layers:
        params["layers"] = {k: conv(np.stack([lp[k] for lp in model.layers])) for k in model.layers[0]}
    else:
        params["layers"] = [{k: conv(v) for k, v in lp.items()} for lp in model.layers]
    params["rope_inv_freq"] = jax.device_put(model.rope_inv_freq.astype(np.float32))
    return params


def allocate_kv_cache(num_layers, num_blocks, block_size, num_kv_heads, head_dim, dtype, stacked: bool):
    """Zeroed (K, V): stacked over layers for the scanned model, per-layer lists for the unrolled one."""
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    if stacked:
        return tuple(jnp.zeros((num_layers, *shape), dtype) for _ in range(2))
    return tuple([jnp.zeros(shape, dtype) for _ in range(num_layers)] for _ in range(2))


class ModelRunner:
    def __init__(self, model: LoadedModel, *, dtype: str, scan_layers: bool, num_blocks: int,
                 block_size: int, max_model_len: int, max_num_seqs: int, max_num_batched_tokens: int,
                 max_logprobs: int, strict_compile_guard: bool = False, show_progress: bool = True):
        self.arch = model.arch
        self.model_module = get_model_module(model.arch.architecture)
        self.dtype = jnp.dtype(dtype)
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.max_model_len = max_model_len
        self.max_blocks_per_seq = -(-max_model_len // block_size)
        self.max_logprobs = max_logprobs
        self.strict = strict_compile_guard
        self.show_progress = show_progress
        self.buckets = bk.step_buckets(max_num_batched_tokens, max_num_seqs)

        self.params = _to_device_params(model, self.dtype, scan_layers)
        a = self.arch
        self.kv = allocate_kv_cache(a.num_layers, num_blocks, block_size, a.num_kv_heads, a.head_dim,
                                    self.dtype, stacked=scan_layers)
        self._step_fn = make_step(self.arch, self.model_module, max_logprobs)
        self._compiled: dict[tuple[int, int], object] = {}
        self._states: dict[str, _ReqState] = {}
        self.warm = False
        self.compile_seconds = 0.0
        # Held before sampling when set (tests use it to pause the first step).
        self.before_step_hook = None

    # ------------------------------------------------------------------ sizes

    def kv_cache_bytes(self) -> int:
        """Bytes the KV arrays actually occupy on the device."""
        return sum(int(a.nbytes) for a in jax.tree.leaves(self.kv))

    def weight_bytes(self) -> int:
        return sum(int(a.nbytes) for a in jax.tree.leaves(self.params))

    # ------------------------------------------------------------------ AOT warm-up

    def _input_spec(self, T: int, S: int) -> StepInputs:
        i32, f32, u32 = jnp.int32, jnp.float32, jnp.uint32

        def sds(shape, dt):
            return jax.ShapeDtypeStruct(shape, dt)

        return StepInputs(
            input_ids=sds((T,), i32),
            attn=AttentionMetadata(positions=sds((T,), i32), slot_mapping=sds((T,), i32),
                                   token_seq=sds((T,), i32),
                                   block_tables=sds((S, self.max_blocks_per_seq), i32),
                                   seq_lens=sds((S,), i32), query_start_loc=sds((S + 1,), i32)),
            logits_indices=sds((S,), i32),
            sampling=SamplingMetadata(temperature=sds((S,), f32), top_k=sds((S,), i32), top_p=sds((S,), f32),
                                      min_p=sds((S,), f32), seed_lo=sds((S,), u32), seed_hi=sds((S,), u32),
                                      out_pos=sds((S,), i32), num_logprobs=sds((S,), i32)))

    def warmup(self) -> None:
        """Compiles the step for every bucket (through the persistent cache)."""
        cc.install_listeners()
        spec = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)  # noqa: E731
        params_spec = jax.tree.map(spec, self.params)
        kv_spec = jax.tree.map(spec, self.kv)
        jitted = jax.jit(self._step_fn, donate_argnums=(1,))
        t0 = time.perf_counter()
        bar = None
        if self.show_progress:
            from tqdm import tqdm
            bar = tqdm(total=len(self.buckets), desc="compiling step buckets", unit="bucket", leave=False)

        def build(bucket):
            T, S = bucket
            compiled = jitted.lower(params_spec, kv_spec, self._input_spec(T, S)).compile()
            if bar is not None:
                bar.update(1)
            return bucket, compiled

        # XLA compiles outside the GIL: two at a time is ~1.3x faster on two cores.
        with ThreadPoolExecutor(max_workers=min(2, os.cpu_count() or 1)) as pool:
            self._compiled = dict(pool.map(build, self.buckets))
        if bar is not None:
            bar.close()
        self.compile_seconds = time.perf_counter() - t0
        self.warm = True
        log.info("compiled %d step buckets in %.1f s", len(self.buckets), self.compile_seconds)

    # ------------------------------------------------------------------ one step

    def _update_states(self, so: SchedulerOutput) -> None:
        for rid in so.finished_req_ids:
            self._states.pop(rid, None)
        for nr in so.scheduled_new_reqs:
            self._states[nr.req_id] = _ReqState.from_new(nr)
        c = so.scheduled_cached_reqs
        for rid, blocks, n in zip(c.req_ids, c.new_block_ids, c.num_computed_tokens):
            st = self._states[rid]
            st.block_ids.extend(blocks)
            st.num_computed_tokens = n

    def _prepare(self, so: SchedulerOutput) -> tuple[StepInputs, list[str], list[bool], tuple[int, int]]:
        rows = list(so.num_scheduled_tokens.items())
        T, S = so.total_num_scheduled_tokens, len(rows)
        Tb, Sb = bk.pick(T, S, self.buckets)
        BS = self.block_size
        input_ids = np.zeros(Tb, np.int32)
        positions = np.zeros(Tb, np.int32)
        slots = np.zeros(Tb, np.int32)   # padding tokens write into the null block 0
        token_seq = np.zeros(Tb, np.int32)
        tables = np.zeros((Sb, self.max_blocks_per_seq), np.int32)
        seq_lens = np.zeros(Sb, np.int32)
        qsl = np.zeros(Sb + 1, np.int32)
        logits_idx = np.zeros(Sb, np.int32)
        temp = np.zeros(Sb, np.float32)
        top_k = np.zeros(Sb, np.int32)
        top_p = np.ones(Sb, np.float32)
        min_p = np.zeros(Sb, np.float32)
        seed_lo = np.zeros(Sb, np.uint32)
        seed_hi = np.zeros(Sb, np.uint32)
        out_pos = np.zeros(Sb, np.int32)
        n_lp = np.full(Sb, -1, np.int32)
        samples = []
        off = 0
        for i, (rid, n) in enumerate(rows):
            st = self._states[rid]
            c = st.num_computed_tokens
            pos = np.arange(c, c + n, dtype=np.int32)
            blocks = np.asarray(st.block_ids, np.int32)
            input_ids[off:off + n] = st.token_ids[c:c + n]
            positions[off:off + n] = pos
            slots[off:off + n] = blocks[pos // BS] * BS + pos % BS
            token_seq[off:off + n] = i
            tables[i, :len(blocks)] = blocks
            seq_lens[i] = c + n
            off += n
            qsl[i + 1] = off
            logits_idx[i] = off - 1
            samples.append(c + n == len(st.token_ids))
            temp[i], top_k[i], top_p[i], min_p[i] = st.temperature, st.top_k, st.top_p, st.min_p
            seed_lo[i], seed_hi[i] = st.seed_lo, st.seed_hi
            out_pos[i] = len(st.token_ids) - st.num_prompt_tokens
            n_lp[i] = st.num_logprobs if samples[-1] else -1
        qsl[S + 1:] = off
        inputs = StepInputs(
            input_ids=input_ids,
            attn=AttentionMetadata(positions=positions, slot_mapping=slots, token_seq=token_seq,
                                   block_tables=tables, seq_lens=seq_lens, query_start_loc=qsl),
            logits_indices=logits_idx,
            sampling=SamplingMetadata(temperature=temp, top_k=top_k, top_p=top_p, min_p=min_p,
                                      seed_lo=seed_lo, seed_hi=seed_hi, out_pos=out_pos, num_logprobs=n_lp))
        return inputs, [r for r, _ in rows], samples, (Tb, Sb)

    def execute(self, so: SchedulerOutput) -> RunnerOutput:
        self._update_states(so)
        if so.total_num_scheduled_tokens == 0:
            return EMPTY_RUNNER_OUTPUT
        if not self.warm:
            raise RuntimeError("ModelRunner.execute called before warmup()")
        before = cc.counts()
        inputs, req_ids, samples, bucket = self._prepare(so)
        if self.before_step_hook is not None:
            self.before_step_hook()
        if self.strict:
            with jax.no_tracing(True):
                out = self._run(bucket, inputs)
        else:
            out = self._run(bucket, inputs)
        after = cc.counts()
        if after["traces"] > before["traces"] or after["compiles"] > before["compiles"]:
            msg = (f"step for bucket {bucket} traced {after['traces'] - before['traces']} and compiled "
                   f"{after['compiles'] - before['compiles']} programs after warm-up")
            if self.strict:
                raise CompileGuardError(msg)
            log.warning(msg)
        tokens, lp, rank, top_ids, top_lp = out
        sampled: list[list[int]] = []
        logprobs: dict[str, list[SampleLogprobs]] = {}
        for i, rid in enumerate(req_ids):
            if not samples[i]:
                sampled.append([])
                continue
            tok = int(tokens[i])
            st = self._states[rid]
            st.token_ids.append(tok)
            sampled.append([tok])
            if st.num_logprobs >= 0:
                k = st.num_logprobs
                logprobs[rid] = [SampleLogprobs(
                    token_ids=[tok] + top_ids[i, :k].tolist(), logprobs=[float(lp[i])] + top_lp[i, :k].tolist(),
                    sampled_rank=int(rank[i]))]
        return RunnerOutput(req_ids=req_ids, sampled_token_ids=sampled, logprobs=logprobs)

    def _run(self, bucket, inputs: StepInputs):
        dev_inputs = jax.device_put(inputs)
        self.kv, out = self._compiled[bucket](self.params, self.kv, dev_inputs)
        return jax.device_get((out.token_ids, out.sampled_logprob, out.sampled_rank, out.top_ids, out.top_logprobs))
