"""ModelRunner: the only component that touches device arrays.

It keeps per-request host state keyed by request id (tokens, block table, sampling
parameters, the request's row of the sampler's device state), turns each
``SchedulerOutput`` into padded numpy arrays, picks the compiled step of the (T, S) bucket,
runs it with the KV cache and the sampler state donated, then the compiled sampler of its
S on the logits it left on the device, and returns the sampled tokens as plain Python
lists.  Buckets are compiled from ``ShapeDtypeStruct``s, all at start-up for a server, or
each the first time a step needs it for one-shot use; saved compiled programs are loaded
instead (runner/program_cache.py).  A step of a compiled bucket that traces or compiles is
a bug, reported by the compile guard (fatal in tests).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from jaxllm.cpu import layout
from jaxllm.errors import CompileGuardError
from jaxllm.host_memory import return_freed_memory
from jaxllm.layers.attention import AttentionMetadata
from jaxllm.models.loader import LoadedModel
from jaxllm.models.registry import get_model_module
from jaxllm.outputs import EMPTY_RUNNER_OUTPUT, LogprobsArrays, NewRequestData, RunnerOutput, SchedulerOutput
from jaxllm.parallel import mesh as pmesh
from jaxllm.parallel import sharding as psh
from jaxllm.runner import buckets as bk
from jaxllm.runner import compile as cc
from jaxllm.runner import packing
from jaxllm.runner import weights
from jaxllm.runner.program_cache import ProgramCache, describe_args
from jaxllm.runner.step import StepInputs, make_sample_step, make_step
from jaxllm.sample import metadata as smd
from jaxllm.sample.sampler import LOGPROBS_MODES, SamplingMetadata, init_state, write_bias_row, write_penalty_row

log = logging.getLogger("jaxllm.runner")


@dataclass
class _ReqState:
    token_ids: list[int]
    num_prompt_tokens: int
    block_ids: list[int]
    num_computed_tokens: int
    sampling: smd.RowParams
    slot: int
    """The request's row of the sampler's device state (penalty counts, bias row)."""
    fresh: bool = True
    """The slot still holds a previous request's counts: the first step resets them."""
    prompt_lps: list[LogprobsArrays] | None = None
    """prompt_logprobs gathered chunk by chunk, delivered with the first sampled token."""

    @classmethod
    def from_new(cls, nr: NewRequestData, vocab_size: int, slot: int) -> "_ReqState":
        # A prefix-cache hit admits a request with num_computed_tokens > 0: the cached tokens
        # never pass through a step, so _prepare writes their penalty counts (prompt mask,
        # output counts) into the request's row before its first step.
        p = smd.RowParams.from_sampling_params(nr.sampling_params, nr.seed, vocab_size)
        # A request resumed after preemption has delivered its prompt logprobs already.
        wants_plp = p.num_prompt_logprobs >= 0 and len(nr.token_ids) == nr.num_prompt_tokens
        return cls(token_ids=list(nr.token_ids), num_prompt_tokens=nr.num_prompt_tokens,
                   block_ids=list(nr.block_ids), num_computed_tokens=nr.num_computed_tokens,
                   sampling=p, slot=slot, prompt_lps=[] if wants_plp else None)

    @property
    def num_logprobs(self) -> int:
        return self.sampling.num_logprobs


class ModelRunner:
    def __init__(self, model: LoadedModel, *, dtype: str, scan_layers: bool, num_blocks: int | None,
                 matmul_backend: str = "xla", attention_backend: str = "xla", sampler_backend: str = "xla",
                 block_size: int, max_model_len: int, max_num_seqs: int, max_num_batched_tokens: int,
                 max_logprobs: int, strict_compile_guard: bool = False, show_progress: bool = True,
                 logprobs_mode: str = "raw_logprobs", use_fp64_gumbel: bool = False,
                 devices: list | None = None, expert_parallel: bool = False, program_dir: str | None = None):
        """``program_dir``: where compiled programs are saved and loaded (runner/program_cache.py);
        None keeps none."""
        if logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"--logprobs-mode must be one of {', '.join(LOGPROBS_MODES)}, got {logprobs_mode!r}")
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

        # XLA:CPU has no bf16 scatter/gather/update kernels: keep bf16 as uint16 bits there.
        self.packed_bf16 = self.dtype == jnp.bfloat16 and jax.default_backend() == "cpu"
        # Every array lives on this replica's mesh, laid out by the logical-axis rules; the
        # steps are compiled (and run) with exactly these shardings.
        self.mesh = pmesh.make_mesh(devices or jax.devices()[:1])
        self.tp = self.mesh.devices.size
        self.rules = psh.rules_for(model.arch, self.tp, expert_parallel)
        self._rep = pmesh.replicated(self.mesh)
        # The native CPU matmul runs unsharded, on its own layout (fused projections cut its
        # calls from 7 to 4 per unrolled layer; panels, see cpu/layout.py).  Elsewhere XLA's
        # dot and the partitioner see the checkpoint's layout.
        native = matmul_backend == "native"
        if native and self.tp > 1:
            raise ValueError("the native CPU matmul does not shard; use --cpu-matmul xla with "
                             "--tensor-parallel-size > 1")
        t0 = time.perf_counter()
        self.params = weights.to_device_params(model, self.dtype, scan_layers, self.packed_bf16, self.mesh, self.rules,
                                        native)
        log.info("weights on the device: %.1f MiB as %s%s in %.1f s", self.weight_bytes() / 2**20,
                 "bfloat16" if self.packed_bf16 else self.dtype.name,
                 ", in the native matmul's panel layout" if native else "", time.perf_counter() - t0)
        self.scan_layers = scan_layers
        self.kv = None
        if num_blocks is not None:
            self.allocate_kv(num_blocks)
        a = self.arch
        self.matmul_backend = matmul_backend
        self.attention_backend = attention_backend
        self.sampler_backend = sampler_backend
        moe_impl = "expert_parallel" if expert_parallel else None
        self._step_fn = make_step(self.arch, self.model_module, max_logprobs, matmul_backend,
                                  attention_backend=attention_backend, moe_impl=moe_impl)
        self._sample_fn = make_sample_step(max_logprobs, sampler_backend=sampler_backend,
                                           logprobs_mode=logprobs_mode, use_fp64_gumbel=use_fp64_gumbel)
        # What decides the compiled programs besides their arguments' shapes (program_cache.py).
        self._step_desc = (f"step|{a!r}|{self.model_module.__name__}|max_logprobs={max_logprobs}|"
                           f"matmul={matmul_backend}|attention={attention_backend}|moe={moe_impl}|"
                           f"blocks_per_seq={self.max_blocks_per_seq}|rules={sorted(self.rules.items())!r}")
        self._sample_desc = (f"sample|max_logprobs={max_logprobs}|sampler={sampler_backend}|"
                             f"logprobs_mode={logprobs_mode}|fp64={use_fp64_gumbel}|vocab={a.vocab_size}")
        # Multi-process programs are not saved: each host would load its own copy unchecked.
        self.programs = ProgramCache(program_dir if jax.process_count() == 1 else None, self.mesh.devices.flat)
        # The sampler's per-request device state: one row per running request (assigned by
        # request id, reused once freed) and a last scratch row for padding rows.
        self.vocab_size = a.vocab_size
        self.sstate = jax.tree.map(lambda x: pmesh.place(np.asarray(x), self._rep),
                                   init_state(max_num_seqs + 1, a.vocab_size))
        self._free_slots = list(range(max_num_seqs - 1, -1, -1))
        self._write_bias = None
        self._bias_writes: list[tuple[int, np.ndarray]] = []
        self._write_penalty = None
        self._penalty_writes: list[tuple[int, np.ndarray, np.ndarray]] = []
        self._plp_plan: list[tuple[str, int, int]] = []
        self._last_prompt_targets = None
        self._compiled: dict[tuple[int, int], object] = {}        # bucket (T, S) -> compiled step
        self._samplers: dict[int, object] = {}                       # S -> compiled sample_step
        self._states: dict[str, _ReqState] = {}
        self.warm = False
        self.compile_seconds = 0.0
        self.programs_compiled = 0    # step and sampler programs compiled by this runner
        self.programs_loaded = 0      # ... and loaded from the program cache instead
        # Held before sampling when set (tests use it to pause the first step).
        self.before_step_hook = None

    # ------------------------------------------------------------------ sizes

    def _kv_arrays(self, num_blocks: int, shapes_only: bool = False):
        """The (K, V) cache laid out over the mesh (``kv_heads`` split when the rules say so);
        ``shapes_only``: ShapeDtypeStructs carrying the shardings, nothing allocated."""
        a = self.arch
        sharding = NamedSharding(self.mesh, psh.kv_spec(self.rules, self.scan_layers))
        specs = weights.allocate_kv_cache(a.num_layers, num_blocks, self.block_size, a.num_kv_heads, a.head_dim,
                                  jnp.uint16 if self.packed_bf16 else self.dtype, stacked=self.scan_layers,
                                  make=functools.partial(jax.ShapeDtypeStruct, sharding=sharding))
        if shapes_only:
            return specs
        # One program zeroes every layer's K and V; each device allocates only its own shards.
        return jax.jit(lambda: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), specs),
                       out_shardings=jax.tree.map(lambda s: s.sharding, specs))()

    def allocate_kv(self, num_blocks: int) -> None:
        """Allocates the KV cache (a runner built with ``num_blocks=None`` waits for its size)."""
        self.num_blocks = num_blocks
        self.kv = self._kv_arrays(num_blocks)

    def activation_bytes(self) -> int:
        """The largest step's temporary memory as XLA compiled it (the KV cache, donated and
        updated in place, is not part of it): what ``--gpu-memory-utilization`` sets aside."""
        T, S = max(self.buckets)
        out = 0
        # The step and then the sampler run one after the other: the larger of the two.
        for lowered in (self._lower(self._kv_arrays(2, shapes_only=True), T, S), self._lower_sample(S)):
            analysis = lowered.compile().memory_analysis()
            out = max(out, int(getattr(analysis, "temp_size_in_bytes", 0) or 0) if analysis is not None else 0)
        return out

    def kv_cache_bytes(self) -> int:
        """Bytes the KV arrays actually occupy on the device."""
        return sum(int(a.nbytes) for a in jax.tree.leaves(self.kv))

    def weight_bytes(self) -> int:
        return sum(int(a.nbytes) for a in jax.tree.leaves(self.params))

    # ------------------------------------------------------------------ AOT warm-up

    def _lower(self, kv_spec, T: int, S: int):
        """The step of bucket (T, S), traced under this replica's mesh and lowered with the
        shardings serving uses: the cache and sampler state keep theirs (donated, in place),
        everything else is replicated."""
        spec = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)  # noqa: E731
        kv_shardings = jax.tree.map(lambda x: x.sharding, kv_spec)
        sstate_spec = jax.tree.map(spec, self.sstate)
        inputs_spec = self._input_spec(T, S)

        # The sampling metadata's words also leave the step, so the sampler reads them from the
        # device: the inputs are packed and sent once per step.
        lo, hi = packing.span(inputs_spec, inputs_spec.sampling)

        def step(params, kv, sstate, words):   # words: the step's inputs, packing.pack'ed
            return (*self._step_fn(params, kv, sstate, packing.unpack(words, inputs_spec)), words[lo:hi])

        jitted = jax.jit(step, donate_argnums=(1, 2),
                         out_shardings=(kv_shardings, jax.tree.map(lambda x: x.sharding, sstate_spec),
                                        self._rep, self._rep, self._rep))
        words = jax.ShapeDtypeStruct((packing.num_words(inputs_spec),), jnp.uint32, sharding=self._rep)
        with jax.set_mesh(self.mesh):
            return jitted.lower(jax.tree.map(spec, self.params), kv_spec, sstate_spec, words)

    def _lower_sample(self, S: int):
        """The sampler of sequence bucket S: (sampler state, logits [S, V], packed sampling
        metadata) -> SamplerOutput; the state is read, not donated (the step updated it)."""
        spec = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)  # noqa: E731
        md_spec = self._sampling_spec(S)

        def sample_step(sstate, logits, words):   # words: the sampling metadata, packing.pack'ed
            return self._sample_fn(sstate, logits, packing.unpack(words, md_spec))

        logits = jax.ShapeDtypeStruct((S, self.vocab_size), jnp.float32, sharding=self._rep)
        words = jax.ShapeDtypeStruct((packing.num_words(md_spec),), jnp.uint32, sharding=self._rep)
        with jax.set_mesh(self.mesh):
            return jax.jit(sample_step, out_shardings=self._rep).lower(jax.tree.map(spec, self.sstate), logits, words)

    def _sampling_spec(self, S: int) -> SamplingMetadata:
        return smd.to_metadata({k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=self._rep)
                                for k, v in smd.empty_metadata(S).items()})

    def _input_spec(self, T: int, S: int) -> StepInputs:
        i32 = jnp.int32

        def sds(shape, dt):
            return jax.ShapeDtypeStruct(shape, dt, sharding=self._rep)

        return StepInputs(
            input_ids=sds((T,), i32),
            attn=AttentionMetadata(positions=sds((T,), i32), slot_mapping=sds((T,), i32),
                                   token_seq=sds((T,), i32),
                                   block_tables=sds((S, self.max_blocks_per_seq), i32),
                                   seq_lens=sds((S,), i32), query_start_loc=sds((S + 1,), i32)),
            logits_indices=sds((S,), i32),
            sampling=self._sampling_spec(S),
            prompt_targets=sds((T,), i32))

    def warmup(self, every_bucket: bool = True) -> None:
        """Compiles the small programs that write sampler rows and, with ``every_bucket``, the
        step of every bucket and the sampler of every sequence bucket (what a server needs
        before its first request).  Without it a bucket is compiled the first time a step
        needs it (:meth:`compile_buckets`); the compile guard then covers the buckets compiled."""
        cc.install_listeners()
        spec = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)  # noqa: E731
        rep = functools.partial(jax.ShapeDtypeStruct, sharding=self._rep)
        bias = self.sstate.bias
        self._write_bias = jax.jit(write_bias_row, donate_argnums=(0,), out_shardings=self._rep).lower(
            spec(bias), rep((), jnp.int32), rep((bias.shape[1],), jnp.float32)).compile()
        V = self.sstate.counts.shape[1]
        self._write_penalty = jax.jit(write_penalty_row, donate_argnums=(0, 1), out_shardings=self._rep).lower(
            spec(self.sstate.counts), spec(self.sstate.prompt_mask), rep((), jnp.int32),
            rep((V,), jnp.int32), rep((V,), jnp.bool_)).compile()
        self.warm = True
        if every_bucket:
            self.compile_buckets(self.buckets)

    @property
    def all_compiled(self) -> bool:
        return all(b in self._compiled and b[1] in self._samplers for b in self.buckets)

    def _program_key(self, kind: str, key, args: dict[str, str]) -> str:
        """``args``: :meth:`_args_descriptions`, computed once for a batch of keys."""
        if kind == "step":
            return self.programs.key(f"{self._step_desc}|T={key[0]}|S={key[1]}|{args['step']}")
        return self.programs.key(f"{self._sample_desc}|S={key}|{args['sample']}")

    def _args_descriptions(self) -> dict[str, str]:
        spec = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)  # noqa: E731
        sstate = jax.tree.map(spec, self.sstate)
        return {"step": describe_args(jax.tree.map(spec, self.params), jax.tree.map(spec, self.kv), sstate),
                "sample": describe_args(sstate)}

    def compile_buckets(self, buckets) -> None:
        """Makes the step of each of ``buckets`` and the sampler of each of their sequence
        buckets ready: loaded from the program cache when it holds them, else compiled
        (through JAX's persistent cache) and saved there.  Already-ready ones are skipped."""
        cc.install_listeners()
        spec = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)  # noqa: E731
        kv_spec = jax.tree.map(spec, self.kv)
        jobs = [("step", b) for b in sorted(set(buckets)) if b not in self._compiled]
        jobs += [("sample", S) for S in sorted({S for _, S in buckets}) if S not in self._samplers]
        if not jobs:
            return
        t0 = time.perf_counter()
        args = self._args_descriptions()
        keys = {job: self._program_key(*job, args) for job in jobs}
        cached = {job for job in jobs if self.programs.has(keys[job])}
        if len(cached) == len(jobs):
            log.info("loading %d programs from the cache", len(jobs))
        else:
            log.info("compiling %d programs (%d from the cache)", len(jobs), len(cached))
        bar = None
        if self.show_progress:
            from tqdm import tqdm
            bar = tqdm(total=len(jobs), unit="program", leave=False,
                       desc=f"loading {len(cached)} programs from the cache" if len(cached) == len(jobs)
                       else f"compiling {len(jobs) - len(cached)} programs, {len(cached)} from the cache")
        counts = {"loaded": 0, "compiled": 0}

        def build(job):
            kind, key = job
            compiled = self.programs.load(keys[job]) if job in cached else None
            how = "loaded"
            if compiled is None:
                lower = (lambda: self._lower(kv_spec, *key)) if kind == "step" else (lambda: self._lower_sample(key))
                compiled = self.programs.compile(keys[job], lower)
                how = "compiled"
            counts[how] += 1
            if bar is not None:
                bar.set_postfix_str(f"{counts['compiled']} compiled, {counts['loaded']} loaded", refresh=False)
                bar.update(1)
            return job, compiled

        # XLA compiles outside the GIL: two at a time is ~1.3x faster on two cores.
        with ThreadPoolExecutor(max_workers=min(2, os.cpu_count() or 1)) as pool:
            built = dict(pool.map(build, jobs))
        if bar is not None:
            bar.close()
        self._compiled.update({key: c for (kind, key), c in built.items() if kind == "step"})
        self._samplers.update({key: c for (kind, key), c in built.items() if kind == "sample"})
        seconds = time.perf_counter() - t0
        self.compile_seconds += seconds
        self.programs_compiled += counts["compiled"]
        self.programs_loaded += counts["loaded"]
        if counts["compiled"]:
            return_freed_memory()   # XLA's compile-time buffers
        log.info("%d programs ready in %.1f s: %d compiled, %d loaded from the cache (%s)", len(jobs), seconds,
                 counts["compiled"], counts["loaded"], self.programs.root or "no program cache")

    # ------------------------------------------------------------------ one step

    def _update_states(self, so: SchedulerOutput) -> None:
        for rid in so.finished_req_ids:
            st = self._states.pop(rid, None)
            if st is not None:
                self._free_slots.append(st.slot)
        for nr in so.scheduled_new_reqs:
            old = self._states.pop(nr.req_id, None)
            if old is not None:
                self._free_slots.append(old.slot)
            self._states[nr.req_id] = _ReqState.from_new(nr, self.vocab_size, self._free_slots.pop())
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
        prompt_targets = np.full(Tb, -1, np.int32)
        md = smd.empty_metadata(Sb)
        md["slot"][:] = self.sstate.counts.shape[0] - 1     # padding rows: the scratch row
        samples = []
        self._plp_plan = []       # (request id, first flat token, number of prompt logprobs)
        self._bias_writes = []    # (slot, row): bias rows to write before the step
        self._penalty_writes = []  # (slot, counts row, prompt-mask row): cached tokens' counts
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
            if st.prompt_lps is not None and c < st.num_prompt_tokens - 1:
                m = min(c + n, st.num_prompt_tokens - 1) - c   # positions whose next token is a prompt token
                prompt_targets[off:off + m] = st.token_ids[c + 1:c + 1 + m]
                self._plp_plan.append((rid, off, m))
            off += n
            qsl[i + 1] = off
            logits_idx[i] = off - 1
            samples.append(c + n == len(st.token_ids))
            p = st.sampling
            num_out = len(st.token_ids) - st.num_prompt_tokens
            # Only min_tokens and multi-token bad words look at the outputs: no per-step copy otherwise.
            needs_outputs = samples[-1] and (p.min_tokens > 0 or p.bad_word_seqs)
            reset = st.fresh and p.uses_penalties
            if reset and c > 0:
                # Tokens before c came from the prefix cache: write their counts into the row
                # (replacing whatever it held), and do not zero it inside the step.
                self._penalty_writes.append((st.slot, *self._penalty_row(st, c)))
                reset = False
            smd.fill_row(md, i, p, slot=st.slot, out_pos=num_out, num_prompt=st.num_prompt_tokens,
                         reset=reset,
                         suppress=p.suppressed(st.token_ids[st.num_prompt_tokens:]) if needs_outputs else [],
                         num_logprobs=p.num_logprobs if samples[-1] else -1)
            if st.fresh and p.bias_row is not None:
                self._bias_writes.append((st.slot, p.bias_row))
            st.fresh = False
        qsl[S + 1:] = off
        inputs = StepInputs(
            input_ids=input_ids,
            attn=AttentionMetadata(positions=positions, slot_mapping=slots, token_seq=token_seq,
                                   block_tables=tables, seq_lens=seq_lens, query_start_loc=qsl),
            logits_indices=logits_idx,
            sampling=smd.to_metadata(md),
            prompt_targets=prompt_targets)
        return inputs, [r for r, _ in rows], samples, (Tb, Sb)

    def execute(self, so: SchedulerOutput) -> RunnerOutput:
        self._update_states(so)
        if so.total_num_scheduled_tokens == 0:
            return EMPTY_RUNNER_OUTPUT
        if not self.warm:
            raise RuntimeError("ModelRunner.execute called before warmup()")
        bucket = bk.pick(so.total_num_scheduled_tokens, len(so.num_scheduled_tokens), self.buckets)
        if bucket not in self._compiled or bucket[1] not in self._samplers:
            # On demand: this bucket, and the decode step of as many requests, which follows
            # (compiled side by side); the guard covers both from now on.
            S = len(so.num_scheduled_tokens)
            self.compile_buckets([bucket, bk.pick(S, S, self.buckets)])
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
        (tokens, lp, rank, top_ids, top_lp), plp = out
        if plp is not None:
            self._gather_prompt_logprobs(plp)
        sampled: list[list[int]] = []
        logprobs: dict[str, LogprobsArrays] = {}
        prompt_out: dict[str, LogprobsArrays] = {}
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
                logprobs[rid] = LogprobsArrays(
                    np.concatenate([tokens[i:i + 1], top_ids[i, :k]])[None], np.concatenate([lp[i:i + 1], top_lp[i, :k]])[None],
                    rank[i:i + 1])
            if st.prompt_lps is not None and len(st.token_ids) == st.num_prompt_tokens + 1:
                prompt_out[rid] = LogprobsArrays.concat(st.prompt_lps)
                st.prompt_lps = None
        return RunnerOutput(req_ids=req_ids, sampled_token_ids=sampled, logprobs=logprobs,
                            prompt_logprobs=prompt_out)

    def _penalty_row(self, st: _ReqState, c: int) -> tuple[np.ndarray, np.ndarray]:
        """The penalty state of a request's first ``c`` tokens, as ``update_state`` would have
        counted them: prompt tokens into the mask, later ones (outputs) into the counts."""
        V = self.vocab_size
        P = min(c, st.num_prompt_tokens)
        mask = np.zeros(V, np.bool_)
        mask[np.asarray(st.token_ids[:P], np.int64)] = True
        counts = np.bincount(np.asarray(st.token_ids[P:c], np.int64), minlength=V).astype(np.int32)
        return counts, mask

    def _gather_prompt_logprobs(self, plp) -> None:
        """Appends this step's prompt logprobs to each asking request's list."""
        lp, rank, top_ids, top_lp = plp
        for rid, start, count in self._plp_plan:
            st = self._states[rid]
            k = st.sampling.num_prompt_logprobs
            rows = slice(start, start + count)
            st.prompt_lps.append(LogprobsArrays(
                np.concatenate([self._last_prompt_targets[rows, None], top_ids[rows, :k]], axis=1),
                np.concatenate([lp[rows, None], top_lp[rows, :k]], axis=1), rank[rows]))

    def _run(self, bucket, inputs: StepInputs):
        """Device part of a step: pending bias rows, then the compiled step; returns host arrays."""
        put = self._put
        for slot, row in self._bias_writes:
            bias = self._write_bias(self.sstate.bias, put(np.int32(slot)), put(row))
            self.sstate = dataclasses.replace(self.sstate, bias=bias)
        self._bias_writes = []
        for slot, counts_row, mask_row in self._penalty_writes:
            counts, mask = self._write_penalty(self.sstate.counts, self.sstate.prompt_mask, put(np.int32(slot)),
                                               put(counts_row), put(mask_row))
            self.sstate = dataclasses.replace(self.sstate, counts=counts, prompt_mask=mask)
        self._penalty_writes = []
        self._last_prompt_targets = inputs.prompt_targets
        # All of the step's inputs in one vector (runner/packing.py).  On one process the
        # compiled call takes it as numpy and transfers it in C++, cheaper again than
        # device_put's Python path; across processes each places its own shards.
        words = packing.pack(inputs)
        if jax.process_count() > 1:
            words = self._put(words)
        self.kv, self.sstate, logits, plp, sampling_words = self._compiled[bucket](
            self.params, self.kv, self.sstate, words)
        out = self._samplers[bucket[1]](self.sstate, logits, sampling_words)
        host = pmesh.to_host((out.token_ids, out.sampled_logprob, out.sampled_rank, out.top_ids, out.top_logprobs))
        return host, (pmesh.to_host(plp) if self._plp_plan else None)

    def _put(self, host) -> jax.Array:
        return pmesh.place(host, self._rep)
