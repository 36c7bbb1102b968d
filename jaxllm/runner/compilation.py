"""Ahead-of-time compilation of the runner's programs, one method per program family: the
step of each bucket (T, S) and the sampler of each sequence bucket S (a pooling engine's steps
sample nothing: it has no sampler programs).

Programs are lowered from ``ShapeDtypeStruct``s carrying the shardings serving uses, and
made ready in this order: loaded from the program cache (runner/program_cache.py), else
compiled (through JAX's persistent cache) and saved there.  Once a bucket is ready, serving
it never traces or compiles (the runner's compile guard checks).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from types import ModuleType

import jax
import jax.numpy as jnp
from tqdm import tqdm

from jaxllm import console, profiling
from jaxllm.host_memory import return_freed_memory
from jaxllm.runner import compile as cc
from jaxllm.runner import inputs as rin
from jaxllm.runner import packing
from jaxllm.runner.flat_call import FlatProgram
from jaxllm.runner.program_cache import ProgramCache, describe_args
from jaxllm.runner.step import make_sample_step, make_step
from jaxllm.runner.step_config import StepConfig
from jaxllm.sample.bitmask import mask_words

log = logging.getLogger("jaxllm.runner")


def spec_of(x) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)


class CompilationManager:
    def __init__(self, cfg: StepConfig, model_module: ModuleType, mesh, replicated, rules: dict,
                 programs: ProgramCache, show_progress: bool):
        self.cfg = cfg
        self.mesh = mesh
        self._rep = replicated
        self.programs = programs
        self.show_progress = show_progress
        self.step_fn = make_step(cfg, model_module)          # the step and the sampler, jittable
        self.sample_fn = make_sample_step(cfg)
        # What decides the programs besides their arguments (the program cache's keys).
        self._step_desc = (f"step|{cfg.arch!r}|{model_module.__name__}|max_logprobs={cfg.max_logprobs}|"
                           f"{cfg.kernels!r}|"
                           f"blocks_per_seq={cfg.max_blocks_per_seq}|drafts={cfg.num_speculative_tokens}|"
                           f"rules={sorted(rules.items())!r}|"
                           # a pooling engine's step has one more output: never another's program
                           f"pooling={cfg.pooling_type}")
        self._sample_desc = (f"sample|max_logprobs={cfg.max_logprobs}|sampler={cfg.sampler_backend}|"
                             f"logprobs_mode={cfg.logprobs_mode}|fp64={cfg.use_fp64_gumbel}|vocab={cfg.arch.vocab_size}|"
                             f"drafts={cfg.num_speculative_tokens}")
        # Called on flat arrays (runner/flat_call.py); ``.compiled`` is the program itself.
        self.steps: dict[tuple[int, int], FlatProgram] = {}      # bucket (T, S) -> compiled step
        self.samplers: dict[int, FlatProgram] = {}               # S -> compiled sampler
        self.seconds = 0.0
        self.compiled = 0    # programs compiled here
        self.loaded = 0      # ... and loaded from the program cache instead

    @property
    def samples(self) -> bool:
        """Whether steps run the sampler: a pooling engine's step samples nothing
        (runner/model_runner.py), so it has no sampler programs."""
        return not self.cfg.pooling_type

    def ready(self, bucket: tuple[int, int]) -> bool:
        return bucket in self.steps and (bucket[1] in self.samplers or not self.samples)

    # ------------------------------------------------------------------ the two families

    def lower_step(self, params, kv, sstate, T: int, S: int):
        """The step of bucket (T, S) under the replica's mesh, with the shardings serving uses:
        the cache and the sampler state keep theirs (donated, updated in place), the rest is
        replicated.  ``params``/``kv``/``sstate``: arrays or ShapeDtypeStructs."""
        params, kv, sstate = (jax.tree.map(spec_of, t) for t in (params, kv, sstate))
        inputs = rin.input_spec(self.cfg, T, S, self._rep)
        # The sampling metadata's words also leave the step, so the sampler reads them from the
        # device: the inputs are packed and sent once per step.
        lo, hi = packing.span(inputs, inputs.sampling)
        step_fn = self.step_fn

        def step(params, kv, sstate, words, *rows):   # words: the step's inputs, packing.pack'ed
            unpacked = packing.unpack(words, inputs)
            if rows:   # a vision-language step: its image rows [T, D] (runner/inputs.image_rows_spec)
                unpacked = dataclasses.replace(unpacked, image_embeds=rows[0])
            return (*step_fn(params, kv, sstate, unpacked), words[lo:hi])

        shardings = lambda t: jax.tree.map(lambda x: x.sharding, t)  # noqa: E731
        # logits, prompt logprobs, (a pooling step's pooled rows,) the sampling words: replicated
        extra = (self._rep,) * (4 if self.cfg.pooling_type else 3)
        jitted = jax.jit(step, donate_argnums=(1, 2), out_shardings=(shardings(kv), shardings(sstate), *extra))
        words = jax.ShapeDtypeStruct((packing.num_words(inputs),), jnp.uint32, sharding=self._rep)
        with jax.set_mesh(self.mesh):
            rows = rin.image_rows_spec(self.cfg, T, self._rep)
            return jitted.lower(params, kv, sstate, words, *(() if rows is None else (rows,)))

    def lower_sampler(self, sstate, S: int):
        """The sampler of sequence bucket S: (sampler state, logits [S, V], packed sampling
        metadata, grammar bitmask [S, ceil(V / 32)] uint32) -> SamplerOutput; the state is
        read, not donated (the step updated it)."""
        md = rin.sampling_spec(S, self._rep, self.cfg.num_speculative_tokens)
        sample_fn = self.sample_fn

        def sample_step(sstate, logits, words, allowed):   # words: the sampling metadata, packing.pack'ed
            return sample_fn(sstate, logits, packing.unpack(words, md), allowed)

        V = self.cfg.arch.vocab_size
        logits = jax.ShapeDtypeStruct((S, V), jnp.float32, sharding=self._rep)
        words = jax.ShapeDtypeStruct((packing.num_words(md),), jnp.uint32, sharding=self._rep)
        allowed = jax.ShapeDtypeStruct((S, mask_words(V)), jnp.uint32, sharding=self._rep)
        with jax.set_mesh(self.mesh):
            return jax.jit(sample_step, out_shardings=self._rep).lower(jax.tree.map(spec_of, sstate), logits, words,
                                                                       allowed)

    def activation_bytes(self, params, kv_shapes, sstate) -> int:
        """The largest step's temporary memory as XLA compiled it (the KV cache, donated and
        updated in place, is not part of it)."""
        T, S = max(self.cfg.buckets)
        out = 0
        # The step and then the sampler run one after the other: the larger of the two.
        programs = [self.lower_step(params, kv_shapes, sstate, T, S)]
        if self.samples:
            programs.append(self.lower_sampler(sstate, S))
        for lowered in programs:
            analysis = lowered.compile().memory_analysis()
            out = max(out, int(getattr(analysis, "temp_size_in_bytes", 0) or 0) if analysis is not None else 0)
        return out

    # ------------------------------------------------------------------ making them ready

    def compile_buckets(self, buckets, params, kv, sstate) -> None:
        """Makes the step of each of ``buckets`` and the sampler of each of their sequence
        buckets ready; already-ready ones are skipped."""
        cc.install_listeners()
        params, kv, sstate = (jax.tree.map(spec_of, t) for t in (params, kv, sstate))
        jobs = [("step", b) for b in sorted(set(buckets)) if b not in self.steps]
        if self.samples:
            jobs += [("sample", S) for S in sorted({S for _, S in buckets}) if S not in self.samplers]
        if not jobs:
            return
        t0 = time.perf_counter()
        args = {"step": describe_args(params, kv, sstate), "sample": describe_args(sstate)}
        keys = {}
        for kind, key in jobs:
            shape = f"T={key[0]}|S={key[1]}" if kind == "step" else f"S={key}"
            desc = self._step_desc if kind == "step" else self._sample_desc
            keys[kind, key] = self.programs.key(f"{desc}|{shape}|{args[kind]}")
        cached = {job for job in jobs if self.programs.has(keys[job])}
        everything_cached = len(cached) == len(jobs)
        if everything_cached:
            log.info("loading %d programs from the cache", len(jobs))
        else:
            log.info("compiling %d programs (%d from the cache)", len(jobs), len(cached))
        bar = None
        if self.show_progress and console.bars_allowed():   # else the two log lines around it
            bar = tqdm(total=len(jobs), unit="program", leave=False,
                       desc=f"loading {len(cached)} programs from the cache" if everything_cached
                       else f"compiling {len(jobs) - len(cached)} programs, {len(cached)} from the cache")
        counts = {"loaded": 0, "compiled": 0}

        def lower(kind, key):
            return self.lower_step(params, kv, sstate, *key) if kind == "step" else self.lower_sampler(sstate, key)

        def build(job):
            compiled = self.programs.load(keys[job]) if job in cached else None
            how = "loaded"
            if compiled is None:
                compiled = self.programs.compile(keys[job], lambda: lower(*job))
                how = "compiled"
            counts[how] += 1
            if bar is not None:
                bar.set_postfix_str(f"{counts['compiled']} compiled, {counts['loaded']} loaded", refresh=False)
                bar.update(1)
            return job, compiled

        # Saved programs load here, one at a time, before any compile starts: deserializing an
        # executable while another thread compiles crashed XLA:CPU (a segfault in jaxlib 0.10.2,
        # seen once in CI), and a load takes ~0.2 s, so nothing is gained by overlapping them.
        built = dict(build(job) for job in jobs if job in cached)
        # XLA compiles outside the GIL: two at a time is ~1.3x faster on two cores.
        with ThreadPoolExecutor(max_workers=min(2, os.cpu_count() or 1)) as pool:
            built.update(pool.map(build, [job for job in jobs if job not in built]))
        if bar is not None:
            bar.close()
        for (kind, key), program in built.items():
            (self.steps if kind == "step" else self.samplers)[key] = FlatProgram(program)
        profiling.register_programs(built.values())   # so a profile's table names the native kernels
        seconds = time.perf_counter() - t0
        self.seconds += seconds
        self.compiled += counts["compiled"]
        self.loaded += counts["loaded"]
        if counts["compiled"]:
            return_freed_memory()   # XLA's compile-time buffers
        log.info("%d programs ready in %.1f s: %d compiled, %d loaded from the cache (%s)", len(jobs), seconds,
                 counts["compiled"], counts["loaded"], self.programs.root or "no program cache")
