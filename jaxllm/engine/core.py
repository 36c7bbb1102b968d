"""EngineCore: the step loop's body.  scheduler -> runner -> scheduler, once per ``step()``.

It builds the runner from the resolved configuration (engine/resolve.py), sizes the KV
cache and warms the runner up, so that once it exists serving never compiles.

Async scheduling (``--async-scheduling``): ``step()`` schedules and dispatches step N+1
while step N runs, then waits for N's tokens and applies them (stop rules, outputs): the
host's scheduling and input preparation overlap the device's work, N's sampled tokens
reaching N+1 on the device (runner/token_feed.py).  Exactness first: a step is run
synchronously (N collected and applied before N+1 is scheduled) while a running request
needs its last token on the host to prepare its next step: structured outputs (the grammar
mask of N+1 follows N's token), ``min_tokens`` and multi-token bad words (they read the
outputs).  Speculative decoding and multi-host serving keep synchronous scheduling.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import random
from dataclasses import dataclass

from jaxllm.config import EngineConfig
from jaxllm.core.kv_budget import KVPlan, utilization_budget
from jaxllm.core.kv_cache_manager import KVCacheManager
from jaxllm.core.scheduler import Scheduler
from jaxllm.lora.config import LoRAConfig
from jaxllm.lora.store import AdapterStore
from jaxllm.lora.targets import lora_targets
from jaxllm.models.loader import LoadedModel, load_model
from jaxllm.models.registry import get_model_module, keeps_sequence_state
from jaxllm.outputs import EngineCoreOutput, EngineCoreOutputs, SchedulerOutput
from jaxllm.parallel import distributed
from jaxllm.parallel.mesh import replica_devices
from jaxllm.engine.resolve import ResolvedConfig, resolve_config
from jaxllm.request import Request
from jaxllm.runner import compile as cc
from jaxllm.runner.model_runner import InFlightStep, ModelRunner
from jaxllm.spec_decode.draft_model import DraftModel

log = logging.getLogger("jaxllm.engine")


@dataclass(frozen=True)
class _Pending:
    """A dispatched step whose tokens are not applied yet (async scheduling)."""

    so: SchedulerOutput
    step: InFlightStep


def _needs_host_tokens(request: Request) -> bool:
    """Whether preparing ``request``'s next step reads its last sampled token on the host."""
    sp = request.sampling_params
    return (sp.structured_outputs is not None or sp.min_tokens > 0
            or any(len(w) > 1 for w in (sp.bad_words_token_ids or ())))


def _use_async(config: EngineConfig) -> bool:
    """Whether the engine schedules asynchronously: asked for, and neither speculative
    decoding (its proposals follow the tokens on the host) nor multi-host (host 0 publishes
    each step before it runs) is on."""
    if not config.scheduler.async_scheduling:
        return False
    if config.speculative_config is not None:
        log.info("async scheduling off: speculative decoding proposes from the sampled tokens on the host")
        return False
    if config.parallel.multi_host:
        log.info("async scheduling off: multi-host serving publishes each step before it runs")
        return False
    return True


def _check_per_sequence_state(config: EngineConfig, model: LoadedModel) -> bool:
    """Whether prefix caching runs.  A model with per-sequence state (a hybrid model's GDN
    layers, models/qwen3_next/) turns it off: a cached prefix's blocks hold the K/V of its
    full-attention layers but not the recurrent state after it.  Speculative decoding is
    refused for such a model, naming the flag."""
    arch = model.arch.architecture
    if not keeps_sequence_state(arch):
        return config.cache.enable_prefix_caching
    if config.speculative_config is not None:
        raise ValueError(f"--speculative-config is not supported for {arch}: its linear-attention layers' recurrent "
                         "state would advance over proposals that are then rejected")
    if config.cache.enable_prefix_caching:
        log.info("prefix caching off: %s keeps a recurrent state per sequence (its GDN layers), which cached "
                 "prefix blocks do not hold", arch)
    return False


def _load_draft(config: EngineConfig, model: LoadedModel) -> LoadedModel:
    """The draft model of ``method: draft_model``, refused by name when it cannot propose for
    ``model``."""
    spec = config.speculative_config
    draft = load_model(spec.model)
    if keeps_sequence_state(draft.arch.architecture):
        raise ValueError(f"--speculative-config: the draft model {spec.model} ({draft.arch.architecture}) keeps a "
                         "recurrent state per sequence, which rejected proposals would leave advanced; "
                         "use an attention-only draft model")
    if draft.arch.vocab_size != model.arch.vocab_size:
        raise ValueError(f"--speculative-config: the draft model {spec.model} has {draft.arch.vocab_size} "
                         f"tokens in its vocabulary and the target {model.arch.vocab_size}: they must be equal")
    return draft


def _draft_model(config: EngineConfig, draft: LoadedModel, r: ResolvedConfig) -> DraftModel:
    """The draft model with its step configuration (the target's ``max_model_len``) for the
    target's runner, which builds the draft's runner (runner/model_runner.py)."""
    spec = config.speculative_config
    # The draft proposes with its own weights only: adapters change the target's verification.
    dcfg = dataclasses.replace(config, model=spec.model, speculative_config=None, quantization=None,
                               lora=LoRAConfig(),
                               scheduler=dataclasses.replace(config.scheduler, max_model_len=r.step.max_model_len))
    try:
        d = resolve_config(dcfg, draft)
    except ValueError as e:
        raise ValueError(f"--speculative-config: the draft model {spec.model}: {e}") from None
    return DraftModel(draft, d.step, spec.model)


class EngineCore:
    def __init__(self, config: EngineConfig, model: LoadedModel, replica: int = 0, grammar=None):
        """``replica``: which data-parallel replica this is (it runs on that slice of the devices);
        ``grammar``: the structured-output grammar compiler (structured/grammar.py), or None."""
        self.config = config
        pc = config.parallel
        devices = replica_devices(pc.tensor_parallel_size, pc.data_parallel_size, replica)
        prefix_caching = _check_per_sequence_state(config, model)
        spec = config.speculative_config
        draft = _load_draft(config, model) if spec is not None and spec.method == "draft_model" else None
        self.resolved = r = resolve_config(config, model, draft)
        draft = _draft_model(config, draft, r) if draft is not None else None
        self.async_scheduling = _use_async(config)
        self._pending: _Pending | None = None
        cc.enable_persistent_cache(r.compile_cache_dir)
        cc.install_listeners()
        # LoRA: the adapters read for this model (the input processor checks a request's here).
        self.lora_store = None
        if r.step.max_loras:
            targets = lora_targets(get_model_module(model.arch.architecture).PARAMS, model.arch)
            self.lora_store = AdapterStore(targets, model.arch.num_layers, r.step.max_lora_rank,
                                           config.lora.cpu_loras)

        def make_runner(step, num_blocks):
            return ModelRunner(
                model, step, num_blocks=num_blocks, devices=devices,
                program_dir=os.path.join(r.compile_cache_dir, "programs"),
                strict_compile_guard=config.runner.strict_compile_guard, show_progress=config.runner.show_progress,
                grammar=grammar, speculative_config=spec, draft=draft, async_scheduling=self.async_scheduling,
                lora_store=self.lora_store, encoder_cache_tokens=config.cache.mm_encoder_cache_tokens,
                mm_processor_kwargs=config.mm_processor_kwargs)
        self.runner = make_runner(r.step, None if r.kv is None else r.kv.num_blocks)
        if r.kv is None:
            kv = self._size_kv_from_device(r.kv_sizing)
            if kv.seqs_asked:
                # Per-sequence state for fewer sequences than asked: the runner was built for
                # max_num_seqs slots, so it is built again for what the budget seats (its
                # weights leave the device before the new one's arrive).
                log.info("max_num_seqs %d clamped to %d: the KV budget holds the per-sequence state of %d "
                         "sequences", kv.seqs_asked, kv.seq_slots, kv.seq_slots)
                r = dataclasses.replace(r, step=dataclasses.replace(r.step, max_num_seqs=kv.seq_slots))
                self.runner = None
                self.runner = make_runner(r.step, None)
            self.resolved = r = dataclasses.replace(r, kv=kv)
            self.runner.allocate_kv(kv.num_blocks)
        log.info("%s; prefix caching %s; scheduling policy %s", r.kv.describe(r.step.max_model_len),
                 "on" if prefix_caching else "off", config.scheduler.scheduling_policy)
        self.kv_manager = KVCacheManager(r.kv.num_blocks, r.kv.block_size, enable_prefix_caching=prefix_caching)
        sc = config.scheduler
        self.scheduler = Scheduler(self.kv_manager, max_num_seqs=r.step.max_num_seqs,
                                   max_num_batched_tokens=r.step.max_num_batched_tokens,
                                   max_model_len=r.step.max_model_len,
                                   policy=sc.scheduling_policy, starvation_steps=sc.starvation_steps,
                                   num_lookahead_tokens=spec.num_speculative_tokens if draft is not None else 0,
                                   async_scheduling=self.async_scheduling, max_loras=r.step.max_loras)
        # auto: on demand for one-shot use; a server compiles the rest when it starts
        # (AsyncEngine), and every host of a multi-host engine compiles all up front.
        mode = config.runner.precompile
        self.runner.warmup(every_bucket=mode == "all" or (mode == "auto" and pc.multi_host))
        # Data-parallel replicas must not hand their unseeded requests the same seeds.
        self._seed_rng = random.Random(config.seed if replica == 0 else f"{config.seed}/replica{replica}")
        # Multi-host: host 0 schedules and publishes each step; the others follow (follow()).
        self.channel = distributed.StepChannel() if pc.multi_host else None

    @property
    def is_follower(self) -> bool:
        return self.channel is not None and not self.channel.is_leader

    def follow(self) -> None:
        """A host other than 0: runs host 0's steps until host 0 stops (shutdown or exit)."""
        if not self.is_follower:
            raise ValueError("follow() is for hosts other than host 0 (--host-index > 0)")
        while True:
            so = self.channel.receive()
            if distributed.is_stop(so):
                return
            self.runner.execute(so)

    def shutdown(self) -> None:
        """Host 0 of a multi-host engine: releases the other hosts from follow()."""
        if self.channel is not None:
            self.channel.close()

    def _size_kv_from_device(self, sizing) -> KVPlan:
        """--gpu-memory-utilization on an accelerator: the weights are on the device now; the
        budget is that fraction of what the device has left, less the largest step's
        activations (as compiled)."""
        util = self.config.cache.gpu_memory_utilization
        stats = self.runner.mesh.devices.flat[0].memory_stats() or {}
        limit, in_use = stats.get("bytes_limit"), stats.get("bytes_in_use")
        if limit is None or in_use is None:
            raise ValueError("--gpu-memory-utilization: this device reports no memory statistics; "
                             "use --kv-cache-memory-bytes")
        act = self.runner.activation_bytes()
        free = limit - in_use
        budget = utilization_budget(util, free, act)
        log.info("--gpu-memory-utilization=%s: %d bytes free after the weights, %d of activations, "
                 "KV budget %d bytes", util, free, act, budget)
        return sizing.plan(budget, measured=True, budget_flag=(
            f"--gpu-memory-utilization={util} ({budget} bytes: {free} free after the weights, "
            f"{act} for activations)"))

    def compile_all(self) -> None:
        """Makes every bucket's programs ready (a server calls it before taking requests)."""
        self.runner.compile_all()

    def new_seed(self) -> int:
        """A 64-bit seed for an unseeded request (reproducible from ``--seed``)."""
        return self._seed_rng.getrandbits(64)

    def add_request(self, request: Request) -> None:
        self.scheduler.add_request(request)

    def remove_lora(self, lora_int_id: int) -> bool:
        """Unloads an adapter no running request uses: its slot zeroed and freed, its host copy
        dropped (a later request naming it reads it again).  Whether it was loaded."""
        if self.lora_store is None:
            raise ValueError("remove_lora: this engine runs without LoRA (enable_lora=True / --enable-lora)")
        slot = self.scheduler.lora.forget(lora_int_id)
        if slot is not None:
            self.runner.unload_lora(slot)
        return self.lora_store.drop(lora_int_id) or slot is not None

    def list_loras(self) -> set[int]:
        """Ids of the adapters resident in device slots."""
        return set() if self.lora_store is None else {l.lora_int_id for l in self.scheduler.lora.resident().values()}

    def abort_requests(self, request_ids) -> list[EngineCoreOutput]:
        return self.scheduler.abort_requests(request_ids)

    def has_unfinished_requests(self) -> bool:
        """Requests not ended, or (async scheduling) a dispatched step not applied yet."""
        return self.scheduler.has_unfinished_requests() or self._pending is not None

    @property
    def step_in_flight(self) -> bool:
        """Async scheduling: a step is dispatched and its tokens not applied yet (the next
        ``step()`` waits for it)."""
        return self._pending is not None

    def step(self) -> EngineCoreOutputs:
        if self.is_follower:
            raise ValueError(f"host {self.channel.host} follows host 0's steps: call follow() there")
        if self.async_scheduling:
            return self._step_async()
        so = self.scheduler.schedule()
        if self.channel is not None:
            self.channel.publish(so)
        if so.is_empty:
            # Still deliver finished ids so the runner drops their state.
            self.runner.execute(so)
            return EngineCoreOutputs([], so.events)
        result = self.runner.execute(so)
        return EngineCoreOutputs(self.scheduler.update_from_output(so, result), so.events)

    def _apply_pending(self) -> list[EngineCoreOutput]:
        """Waits for the dispatched step's tokens and applies them to the scheduler."""
        p, self._pending = self._pending, None
        return self.scheduler.update_from_output(p.so, self.runner.collect(p.step))

    def _step_async(self) -> EngineCoreOutputs:
        """Schedules and dispatches step N+1, then applies step N (which ran meanwhile)."""
        outs: list[EngineCoreOutput] = []
        if self._pending is not None and any(_needs_host_tokens(r) for r in self.scheduler.running):
            # A request reads its last token on the host to prepare its next step: this step
            # waits for the previous one's tokens before it is scheduled (synchronous).
            outs = self._apply_pending()
        so = self.scheduler.schedule()
        h = self.runner.dispatch(so)      # an empty step still drops the ended requests' state
        if self._pending is not None:
            outs += self._apply_pending()
        if h is not None:
            self._pending = _Pending(so, h)
        return EngineCoreOutputs(outs, so.events)
