"""ModelRunner: executes scheduled steps on the device; the only component that holds
device arrays (weights, KV cache, the sampler's state).

One ``execute(SchedulerOutput)``: the requests' host state is updated (runner/requests.py),
the step's inputs prepared on the host (runner/inputs.py), the sampler's staged row writes
applied (sample/states.py), then the compiled step of the (T, S) bucket runs with the KV
cache and the sampler state donated, and the compiled sampler of its S on the logits it left
on the device; the sampled tokens come back as a ``RunnerOutput``.  A pooling engine's step
(``StepConfig.pooling_type``) returns the pooled rows instead, and no sampler runs after it
(none is compiled; its token feed neither).  Constrained requests'
grammar bitmask (structured/matchers.py) is filled on the host after the step is dispatched,
while the device runs the forward, and goes into the sampler; each sampled token then
advances its request's matcher.  Programs are made ready
by runner/compilation.py (all at start-up for a server, or each bucket the first time a step
needs it); a step of a ready bucket that traces or compiles is a bug, reported by the
compile guard (fatal in tests).

Async scheduling (engine/core.py) splits a step in two: ``dispatch(so)`` prepares the step
and launches it, the ids of tokens the previous step is still sampling fed on the device
(runner/token_feed.py), and returns at once; ``collect`` waits for its tokens (their copy to
the host was started at dispatch) and records them.  A step with structured-output rows
needs its previous step collected before its grammar masks are filled: the engine runs such
steps synchronously.
"""

from __future__ import annotations

import dataclasses

import functools
import logging
import time
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from jaxllm.errors import CompileGuardError
from jaxllm.lora.apply import kernel_for, transposes_a
from jaxllm.lora.slots import LoRASlotArrays
from jaxllm.lora.store import AdapterStore
from jaxllm.models.loader import LoadedModel
from jaxllm.models.registry import get_family, get_model_module, keeps_sequence_state
from jaxllm.outputs import EMPTY_RUNNER_OUTPUT, RunnerOutput, SchedulerOutput
from jaxllm.parallel import mesh as pmesh
from jaxllm.parallel import sharding as psh
from jaxllm.quant import ops as qops
from jaxllm.runner import buckets as bk
from jaxllm.runner import compile as cc
from jaxllm.runner import packing, weights
from jaxllm.runner.compilation import CompilationManager
from jaxllm.runner.flat_call import Leaves
from jaxllm.runner.inputs import PreparedStep, num_rows, prepare_sequences
from jaxllm.runner.program_cache import ProgramCache
from jaxllm.runner.qwen_vision import QwenVisionEncoder
from jaxllm.runner.requests import RequestState, RequestStates, SampledStep
from jaxllm.runner.state_slots import StateSlots
from jaxllm.runner.step_config import StepConfig
from jaxllm.runner.token_feed import TokenFeed
from jaxllm.runner.vision import VisionEncoder
from jaxllm.sample.bitmask import mask_words
from jaxllm.sample.states import SamplerRows
from jaxllm.spec_decode.config import SpeculativeConfig
from jaxllm.spec_decode.controller import SpecController, make_controller
from jaxllm.spec_decode.draft_model import DraftModel, DraftSetup
from jaxllm.structured.grammar import GrammarCompiler
from jaxllm.structured.matchers import GrammarStates

log = logging.getLogger("jaxllm.runner")


@dataclass
class InFlightStep:
    """A dispatched step (async scheduling): its inputs, its outputs still on the device, and
    the request states its tokens go to."""

    step: PreparedStep
    outputs: tuple
    """(token ids, sampled logprob, rank, top ids, top logprobs, emitted, prompt logprobs or None)."""
    states: dict[str, RequestState]
    result: RunnerOutput | None = None
    """Set by ``ModelRunner.collect``."""


def _no_tokens(S: int) -> tuple:
    """A pooling step's sampler outputs, on the host: token 0 for each of its ``S`` rows, no
    logprobs, nothing emitted (``SampledStep``'s first six fields)."""
    return (np.zeros(S, np.int32), np.zeros(S, np.float32), np.zeros(S, np.int32), np.zeros((S, 0), np.int32),
            np.zeros((S, 0), np.float32), np.zeros(S, bool))


class ModelRunner:
    def __init__(self, model: LoadedModel, cfg: StepConfig, *, num_blocks: int | None, devices: list | None = None,
                 program_dir: str | None = None, strict_compile_guard: bool = False, show_progress: bool = True,
                 grammar: GrammarCompiler | None = None, speculative_config: SpeculativeConfig | None = None,
                 draft: DraftModel | None = None, async_scheduling: bool = False,
                 lora_store: AdapterStore | None = None, encoder_cache_tokens: int | None = None,
                 mm_processor_kwargs: dict | None = None):
        """``num_blocks``: KV blocks per layer (None: allocated later, :meth:`allocate_kv`);
        ``program_dir``: where compiled programs are saved and loaded (None keeps none);
        ``grammar``: compiles structured-output constraints (None: the engine has no tokenizer);
        ``speculative_config``: speculation on (None: off), ``draft``: its draft model for
        ``method: draft_model``; ``async_scheduling``: steps are run by ``dispatch`` and
        ``collect`` (the module's docstring); ``lora_store``: where the adapters the scheduler
        puts in slots are read from (with ``cfg.max_loras``); ``encoder_cache_tokens``: a
        vision-language model's encoder cache budget (runner/vision.py; None: its default);
        ``mm_processor_kwargs``: Qwen3.5's image processor's min/max pixels (its patch buckets)."""
        self.cfg = cfg
        self.arch = model.arch
        self.strict = strict_compile_guard
        # Every array lives on this replica's mesh, laid out by the logical-axis rules; the
        # steps are compiled (and run) with exactly these shardings.
        self.mesh = pmesh.make_mesh(devices or jax.devices()[:1])
        self.rules = psh.rules_for(model.arch, self.mesh.devices.size, cfg.expert_parallel)
        self._rep = pmesh.replicated(self.mesh)
        native = cfg.kernels.matmul == "native"
        t0 = time.perf_counter()
        self.params = weights.to_device_params(model, jnp.dtype(cfg.dtype), cfg.scan_layers, cfg.packed_bf16,
                                               self.mesh, self.rules, native,
                                               weights.interleaved_types(cfg.kernels))
        leaves = jax.tree.leaves(self.params, is_leaf=qops.is_quantized)
        grouped = sum(1 for w in leaves if getattr(w, "interleaved", 0))
        rounded = qops.rounded_activations(cfg.kernels, leaves)
        log.info("weights on the device: %.1f MiB, %s%s%s%s in %.1f s", self.weight_bytes() / 2**20,
                 qops.summary(leaves), ", in the native matmul's layout" if native else "",
                 f" ({grouped} with rows interleaved by 16 for the VNNI kernel)" if grouped else "",
                 f"; {rounded}," if rounded else "", time.perf_counter() - t0)
        # The step's weights flattened once (runner/flat_call.py); None: to flatten again
        # (the params changed: ``_set_lora_weights``).
        self._flat_params: Leaves | None = None
        # LoRA: the adapters' device slots, a part of the step's params (lora/slots.py).
        self.lora_store = lora_store
        self.lora_slots = None
        if cfg.max_loras:
            if lora_store is None:
                raise ValueError("a LoRA step (max_loras > 0) needs the adapter store")
            lora_specs = psh.lora_specs(lora_store.targets, weights.param_table(model).axes(), self.rules)
            self.lora_slots = LoRASlotArrays(lora_store.targets, model.arch.num_layers, cfg.max_loras,
                                             cfg.max_lora_rank, self._rep, psh.named(self.mesh, lora_specs),
                                             dtype=cfg.lora_dtype,
                                             transposed=transposes_a(kernel_for(cfg.kernels), cfg.lora_dtype))
            self._set_lora_weights()
        self.num_blocks = num_blocks
        self.kv = None if num_blocks is None else self._kv_arrays(num_blocks)
        self.sampler_rows = SamplerRows(cfg.max_num_seqs, model.arch.vocab_size, self._put)
        self.state_slots = StateSlots(cfg.max_num_seqs) if keeps_sequence_state(model.arch.architecture) else None
        self.requests = RequestStates(model.arch.vocab_size, self.sampler_rows, self.state_slots, cfg.pooling_type)
        # A pooling request never runs after the step that ends it: no token is ever fed.
        self.token_feed = (TokenFeed(cfg, self.sampler_rows.scratch + 1, self._rep)
                           if async_scheduling and not cfg.pooling_type else None)
        self.grammars = GrammarStates(grammar, model.arch.vocab_size)
        self._zero_image_rows: dict[int, jax.Array] = {}   # T -> [T, D] zeros on the device (_image_rows)
        self._all_allowed: dict[int, jax.Array] = {}   # S -> [S, W] all-ones bitmask on the device
        # Multi-process programs are not saved: each host would load its own copy unchecked.
        programs = ProgramCache(program_dir if jax.process_count() == 1 else None, self.mesh.devices.flat)
        self.compiler = CompilationManager(cfg, get_model_module(model.arch.architecture), self.mesh, self._rep,
                                           self.rules, programs, show_progress)
        # A vision-language model: its image encoder, a program of its own (runner/vision.py).
        vision = get_family(model.arch.architecture).vision
        # Qwen3.5's variable image grids (M-RoPE) run padded to patch buckets (runner/qwen_vision.py).
        if model.vision is None or not cfg.images:
            self.vision = None
        elif cfg.mrope:
            self.vision = QwenVisionEncoder(vision, model.vision, self._rep, strict_compile_guard, encoder_cache_tokens,
                                            mm_processor_kwargs)
        else:
            self.vision = VisionEncoder(vision, model.vision, self._rep, strict_compile_guard, encoder_cache_tokens)
        self.warm = False
        self.step_seconds: dict[tuple[int, int], float] = {}
        self._cold: set[tuple[int, int]] = set()
        """Buckets that have run once: a program's first run pays for touching its code and
        buffers (about 2x a warm step here), so only the runs after it are averaged."""
        # Speculative decoding: proposes each sampling request's next tokens after its step
        # (spec_decode/controller.py); the scheduler schedules them for verification.  Built
        # once the KV size is known (a draft model's cache has as many blocks as this one's).
        self.speculation: SpecController | None = None
        self.draft_runner: ModelRunner | None = None
        self._spec = (speculative_config, draft, devices, program_dir, show_progress)
        """What the draft's runner is built with, beside the config and the draft."""
        if num_blocks is not None:
            self._start_speculation()

    @property
    def buckets(self) -> list[tuple[int, int]]:
        return self.cfg.buckets

    # ------------------------------------------------------------------ sizes

    def _kv_arrays(self, num_blocks: int, shapes_only: bool = False):
        """The (K, V) cache laid out over the mesh (``kv_heads`` split when the rules say so);
        ``shapes_only``: ShapeDtypeStructs carrying the shardings, nothing allocated."""
        a, cfg = self.arch, self.cfg
        family = get_family(a.architecture).allocate_cache
        if family is not None:
            # The family's own cache (MLA's latent pages; a hybrid model's K/V pages and
            # recurrent states, one slot per sequence the budget seats), laid out over the mesh
            # by the logical axes the family gives each array.
            seqs = {"num_seqs": cfg.max_num_seqs} if keeps_sequence_state(a.architecture) else {}
            specs = family(a, num_blocks, cfg.block_size, cfg.kv_dtype, cfg.scan_layers, make=jax.ShapeDtypeStruct,
                           sharding=lambda axes: NamedSharding(self.mesh, psh.spec(axes, self.rules)), **seqs)
        else:
            sharding = NamedSharding(self.mesh, psh.kv_spec(self.rules, cfg.scan_layers))
            specs = weights.allocate_kv_cache(a.num_layers, num_blocks, cfg.block_size, a.num_kv_heads, a.head_dim,
                                              cfg.kv_dtype, stacked=cfg.scan_layers,
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
        self._start_speculation()

    def _start_speculation(self) -> None:
        """The speculation controller and its proposer (spec_decode/), for ``method:
        draft_model`` with the draft's runner: its KV arrays have as many blocks as this one's,
        addressed by the same block ids (one more cache kind of the one KV manager, counted in
        the same budget: engine/resolve._draft_kinds)."""
        cfg, draft, devices, program_dir, show_progress = self._spec
        if cfg is None or self.speculation is not None:
            return
        setup = None
        if draft is not None:
            self.draft_runner = ModelRunner(draft.model, draft.step, num_blocks=self.num_blocks, devices=devices,
                                            program_dir=program_dir, strict_compile_guard=self.strict,
                                            show_progress=show_progress)
            log.info("draft model %s (%s): its pages of the %d KV blocks, %.1f MiB", draft.name,
                     draft.model.arch.architecture, self.num_blocks, self.draft_runner.kv_cache_bytes() / 2**20)
            setup = DraftSetup(self.draft_runner, self.cfg.block_size, self.cfg.max_num_batched_tokens,
                               self.cfg.max_model_len)
        self.speculation = make_controller(cfg, self.measured_step_seconds, setup)

    def activation_bytes(self) -> int:
        """The largest step's temporary memory as XLA compiled it: what
        ``--gpu-memory-utilization`` sets aside."""
        return self.compiler.activation_bytes(self.params, self._kv_arrays(2, shapes_only=True),
                                              self.sampler_rows.state)

    def kv_cache_bytes(self) -> int:
        """Bytes the KV arrays actually occupy on the device."""
        return sum(int(a.nbytes) for a in jax.tree.leaves(self.kv))

    def weight_bytes(self) -> int:
        return sum(int(a.nbytes) for a in jax.tree.leaves(self.params))

    # ------------------------------------------------------------------ programs

    def warmup(self, every_bucket: bool = True) -> None:
        """Compiles the sampler's row writers and, with ``every_bucket``, every bucket's
        programs (what a server needs before its first request).  Without it a bucket is
        compiled the first time a step needs it; the compile guard covers the ready ones."""
        cc.install_listeners()
        self.sampler_rows.compile()
        if self.vision is not None:
            self.vision.compile()
        if self.lora_slots is not None:
            self.lora_slots.compile()
            self._set_lora_weights()
        self.warm = True
        if every_bucket:
            self.compile_buckets(self.buckets)
        if self.draft_runner is not None:
            self.draft_runner.warmup(every_bucket)

    def compile_buckets(self, buckets) -> None:
        self.compiler.compile_buckets(buckets, self.params, self.kv, self.sampler_rows.state)
        if self.token_feed is not None:
            self.token_feed.compile(buckets)

    def compile_all(self) -> None:
        """Makes every bucket's programs ready, the draft model's too."""
        self.compile_buckets(self.buckets)
        if self.draft_runner is not None:
            self.draft_runner.compile_buckets(self.draft_runner.buckets)

    @property
    def all_compiled(self) -> bool:
        return all(self.compiler.ready(b) for b in self.buckets)

    # ------------------------------------------------------------------ one step

    def execute(self, so: SchedulerOutput) -> RunnerOutput:
        t0 = time.perf_counter()
        self._load_loras(so.lora_loads)
        self.requests.update(so)
        self._encode_images(so)
        self.grammars.update(so)
        if self.speculation is not None:
            self.speculation.update(so)
        if so.total_num_scheduled_tokens == 0:
            return EMPTY_RUNNER_OUTPUT
        step, result = self._step(list(so.num_scheduled_tokens.items()), so.scheduled_spec_decode_tokens,
                                  so.total_num_scheduled_tokens, num_rows(so), t0)
        if self.speculation is not None:
            result = self.speculation.propose(result, step, self.requests, self.grammars)
        return result

    def dispatch(self, so: SchedulerOutput) -> InFlightStep | None:
        """Async scheduling: prepares and launches the step of ``so`` without waiting for it
        (None: nothing to compute).  Its sampling requests count one token in flight until
        :meth:`collect`."""
        if self.speculation is not None:
            raise ValueError("async scheduling does not run speculative decoding")
        self._load_loras(so.lora_loads)
        self.requests.update(so)
        self._encode_images(so)
        self.grammars.update(so)
        if so.total_num_scheduled_tokens == 0:
            return None
        seqs = list(so.num_scheduled_tokens.items())
        step, outputs, _ = self._launch(seqs, {}, so.total_num_scheduled_tokens, num_rows(so))
        states = self.requests.snapshot(step.req_ids)
        for i, rid in enumerate(step.req_ids):
            if step.samples[i]:
                states[rid].inflight += 1
        return InFlightStep(step, outputs, states)

    def collect(self, h: InFlightStep) -> RunnerOutput:
        """Waits for a dispatched step's tokens and records them (once; later calls return the
        same output)."""
        if h.result is None:
            *host, plp, pooled = self._wait(h.outputs)
            h.result = self.requests.record(h.step, SampledStep(*host, prompt=plp, pooled=pooled), h.states)
            self._accept_grammar(h.result)
        return h.result

    def _encode_images(self, so: SchedulerOutput) -> None:
        """Encodes the images of the requests seated this step (the encoder cache skips those
        seen before); their rows go in at the placeholder tokens of each chunk (runner/inputs.py)."""
        for nr in so.scheduled_new_reqs:
            if nr.images:
                if self.vision is None:
                    raise ValueError(f"request {nr.req_id}: images sent to a model that takes none")
                self.requests[nr.req_id].images = self.vision.request_images(nr.images, nr.num_prompt_tokens)

    def unload_lora(self, slot: int) -> None:
        """Zeroes ``slot`` (its adapter was removed)."""
        self._load_loras({slot: None})

    def _load_loras(self, loads: dict) -> None:
        """Writes the adapters the scheduler put in slots this step (slot -> LoRARequest, None:
        zeros); the writer was compiled at warm-up: a write that compiles is a bug (the guard)."""
        if not loads:
            return
        before = cc.counts()
        for slot, lora in loads.items():
            self.lora_slots.write(slot, None if lora is None else self.lora_store.get(lora))
        self._set_lora_weights()
        after = cc.counts()
        if self.warm and (after["traces"] > before["traces"] or after["compiles"] > before["compiles"]):
            msg = (f"loading LoRA adapters traced {after['traces'] - before['traces']} and compiled "
                   f"{after['compiles'] - before['compiles']} programs after warm-up")
            if self.strict:
                raise CompileGuardError(msg)
            log.warning(msg)

    def _set_lora_weights(self) -> None:
        """Puts the adapter slots' arrays (new ones after each write) in the step's params."""
        self.params["lora"] = self.lora_slots.weights
        self._flat_params = None

    def _accept_grammar(self, result: RunnerOutput) -> None:
        if len(self.grammars):
            for rid, toks in zip(result.req_ids, result.sampled_token_ids):
                for tok in toks:
                    self.grammars.accept(rid, tok)

    def run_sequences(self, sched: dict[str, int]) -> RunnerOutput:
        """One step of ``sched`` (request id -> tokens to compute), read from the requests'
        host states as they are (``self.requests``: tokens, computed count, block table): a
        draft model's step, whose proposer keeps those states on the target's block tables
        (spec_decode/draft_model.py).  No scheduler output, no grammar, no speculation."""
        n = len(sched)
        return self._step(list(sched.items()), {}, sum(sched.values()), n, time.perf_counter())[1]

    def _step(self, seqs: list[tuple[str, int]], spec: dict[str, list[int]], num_tokens: int, rows: int,
              t0: float) -> tuple[PreparedStep, RunnerOutput]:
        """Runs ``seqs`` ((request id, tokens) in batch order, verifying ``spec``) in the bucket of
        ``num_tokens`` tokens and ``rows`` sampling rows; the step and its output."""
        step, outputs, timed = self._launch(seqs, spec, num_tokens, rows)
        *host, plp, pooled = self._wait(outputs)
        result = self.requests.record(step, SampledStep(*host, prompt=plp, pooled=pooled))
        self._accept_grammar(result)
        if timed:
            # Each bucket's step time (moving average): what speculation's cost model reads.
            dt = time.perf_counter() - t0
            old = self.step_seconds.get(step.bucket)
            if step.bucket not in self._cold:
                self._cold.add(step.bucket)
            else:
                self.step_seconds[step.bucket] = dt if old is None else 0.8 * old + 0.2 * dt
        return step, result

    def _launch(self, seqs: list[tuple[str, int]], spec: dict[str, list[int]], num_tokens: int,
                rows: int) -> tuple[PreparedStep, tuple, bool]:
        """Prepares the step of ``seqs`` and launches it on the device (compiling its bucket
        first if it was not ready): the step, its outputs (still on the device) and whether
        its bucket was ready before (a step worth timing).  The outputs' copies to the host
        are started here, for ``_wait``."""
        if not self.warm:
            raise RuntimeError("ModelRunner: a step before warmup()")
        S = len(seqs)
        bucket = bk.pick(num_tokens, rows, self.buckets)
        timed = self.compiler.ready(bucket)
        if not timed:
            # On demand: this bucket, and the decode step of as many requests, which follows
            # (compiled side by side; a pooling engine never decodes); the guard covers both from now on.
            self.compile_buckets([bucket] if self.cfg.pooling_type else [bucket, bk.pick(S, S, self.buckets)])
        before = cc.counts()
        step = prepare_sequences(seqs, spec, self.requests, self.cfg, bucket)
        if self.strict:
            with jax.no_tracing(True):
                out = self._run(step)
        else:
            out = self._run(step)
        after = cc.counts()
        if after["traces"] > before["traces"] or after["compiles"] > before["compiles"]:
            msg = (f"step for bucket {step.bucket} traced {after['traces'] - before['traces']} and compiled "
                   f"{after['compiles'] - before['compiles']} programs after warm-up")
            if self.strict:
                raise CompileGuardError(msg)
            log.warning(msg)
        for x in jax.tree.leaves(out):
            if isinstance(x, jax.Array):   # (a pooling step's placeholder tokens are on the host)
                x.copy_to_host_async()   # read by _wait (pmesh.to_host) without waiting for a copy
        return step, out, timed

    def measured_step_seconds(self, num_tokens: int, num_rows: int) -> float | None:
        """The moving average of the steps run in the bucket of ``num_tokens`` in ``num_rows``
        rows, capped by every measured bigger bucket's (a bucket that holds more costs at
        least as much: this keeps a rarely run bucket's noisy average from hiding that it is
        cheap); None if none ran yet (or no bucket holds them)."""
        try:
            T, S = bk.pick(num_tokens, num_rows, self.buckets)
        except ValueError:
            return None
        if (T, S) not in self.step_seconds:
            return None
        return min(sec for (t, s), sec in self.step_seconds.items() if t >= T and s >= S)

    def _run(self, step: PreparedStep) -> tuple:
        """The device part of a step: staged row writes, the compiled step, the sampler; its
        outputs on the device (``InFlightStep.outputs``)."""
        rows = self.sampler_rows
        rows.apply_staged_writes()
        # All of the step's inputs in one vector (runner/packing.py).  On one process the
        # compiled call takes it as numpy and transfers it in C++, cheaper again than
        # device_put's Python path; across processes each places its own shards.
        inputs = step.inputs
        if inputs.image_embeds is not None:   # the image rows go as their own argument (_image_rows)
            inputs = dataclasses.replace(inputs, image_embeds=None)
        words = packing.pack(inputs)
        if jax.process_count() > 1:
            words = self._put(words)
        if step.feed is not None:
            words = self.token_feed.apply(step.bucket, words, step.feed)
        image_rows = () if not self.cfg.images else (self._image_rows(step),)
        if self._flat_params is None:
            self._flat_params = Leaves.of(self.params)
        # ``pooled``: a pooling engine's step's one more output (runner/step.py), else empty.
        self.kv, rows.state, logits, plp, *pooled, sampling_words = self.compiler.steps[step.bucket](
            self._flat_params, self.kv, rows.state, words, *image_rows)
        S = step.bucket[1]
        if self.cfg.pooling_type:
            # A pooling step samples nothing (the scheduler ends its requests with the pooled
            # row): no sampler program runs, nor is one compiled; its tokens are placeholders.
            return (*_no_tokens(S), None, pooled[0])
        # Dispatched, not finished: the grammar masks are computed while the device runs.
        masked = self.grammars.masked_rows(step.rows()) if len(self.grammars) else []
        if masked:
            allowed = self.grammars.fill(masked, S, dict(zip(step.req_ids, step.drafts)))
            if jax.process_count() > 1:
                allowed = self._put(allowed)
        else:
            allowed = self._all_allowed.get(S)
            if allowed is None:
                allowed = self._all_allowed[S] = self._put(
                    np.full((S, mask_words(self.arch.vocab_size)), 0xFFFFFFFF, np.uint32))
        out = self.compiler.samplers[S](rows.state, logits, sampling_words, allowed)
        if self.token_feed is not None:
            self.token_feed.record(S, step.inputs.sampling.slot, out.token_ids)
        return (out.token_ids, out.sampled_logprob, out.sampled_rank, out.top_ids, out.top_logprobs, out.emitted,
                plp if step.prompt_plan else None, pooled[0] if pooled else None)

    def _image_rows(self, step: PreparedStep):
        """A vision-language step's image rows: its own [T, D] when it has image tokens, else the
        bucket's zero buffer, made once and kept on the device (nothing sent)."""
        embeds = step.inputs.image_embeds
        if embeds is not None:
            return embeds if jax.process_count() == 1 else self._put(embeds)
        T = step.bucket[0]
        zeros = self._zero_image_rows.get(T)
        if zeros is None:
            zeros = self._zero_image_rows[T] = self._put(np.zeros((T, self.arch.hidden_size), np.float32))
        return zeros

    def _wait(self, outputs) -> list:
        """Waits for a launched step's outputs and reads them to the host (numpy)."""
        return pmesh.to_host(outputs)

    def _put(self, host) -> jax.Array:
        return pmesh.place(np.asarray(host), self._rep)
