"""LLMEngine: the synchronous engine behind the offline ``LLM`` class and the CLI.

Loads the checkpoint and tokenizer, builds the engine core (which compiles every step
bucket, or with ``precompile`` auto / on-demand each when a step first needs it), queues
the input processor's ``EngineRequest``s (one core ``Request`` per sample) and turns
engine-core outputs into ``RequestOutput``s.  Each start-up phase
is logged (jaxllm.engine) with its size and time.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass

from jaxllm import hub
from jaxllm.config import EngineConfig
from jaxllm.cpu import native
from jaxllm.engine.core import EngineCore
from jaxllm.engine.output_processor import OutputKind, OutputProcessor
from jaxllm.engine.processor import InputProcessor, PromptType
from jaxllm.engine.tokenizer import encode, eos_token_ids, load_tokenizer
from jaxllm.host_memory import return_freed_memory
from jaxllm.lora.request import LoRARequest
from jaxllm.models import qwen3_5_vl
from jaxllm.models.builtin import BUILTIN_MODEL_NAME
from jaxllm.models.loader import TokenizerSource, load_model
from jaxllm.multimodal.prompt_images import PromptImages, newline_ids
from jaxllm.multimodal.qwen_prompt_images import QwenPromptImages
from jaxllm.outputs import RequestOutput, SchedulingEvent
from jaxllm.parallel import distributed
from jaxllm.paths import default_cache_dir
from jaxllm.request import EngineRequest, Request
from jaxllm.sampling_params import SamplingParams
from jaxllm.structured.grammar import GrammarCompiler

log = logging.getLogger("jaxllm.engine")


def _adapter_names(requests) -> tuple[str, ...]:
    """The adapters of ``requests`` by name, each once, in order of first appearance."""
    return tuple(dict.fromkeys(r.lora_request.lora_name for r in requests if r.lora_request is not None))


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of the scheduler and the KV pool, for metrics."""

    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_blocks: int
    """Blocks requests can use (the null block excluded)."""
    num_preemptions: int
    prefix_cache_queries: int = 0
    """Prompt tokens looked up in the prefix cache since start (newly admitted requests)."""
    prefix_cache_hits: int = 0
    """Of those, tokens served from the cache."""
    spec_num_drafts: int = 0
    """Speculative decoding since start: verifications that had proposals, ..."""
    spec_num_draft_tokens: int = 0
    """... the tokens proposed in them, ..."""
    spec_num_accepted_tokens: int = 0
    """... the ones accepted, ..."""
    spec_accepted_per_pos: tuple[int, ...] = ()
    """... and those by position in the proposal (0: the first proposed token)."""
    prompt_tokens_computed: int = 0
    """Prompt tokens run through the model since start, counted per prefill chunk (prefix-cache
    hits excluded; a preempted request's recomputed prompt counted again)."""
    block_size: int = 0
    """Tokens per KV block (0: not known, e.g. a sum over replicas)."""
    max_loras: int = 0
    """LoRA adapter slots (0: the engine runs without LoRA)."""
    running_loras: tuple[str, ...] = ()
    """The adapters of the running requests, by name, each once in order of first appearance ..."""
    waiting_loras: tuple[str, ...] = ()
    """... and of the waiting ones (vLLM's ``lora_requests_info`` labels)."""
    encoder_cache_hits: int = 0
    """A vision-language model's images served from the encoder cache since start (runner/vision.py) ..."""
    encoder_cache_misses: int = 0
    """... and encoded (a preempted request's recompute asks again: a hit or a miss) ..."""
    encoder_cache_entries: int = 0
    """... and the images in it now."""

    @property
    def kv_cache_usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks if self.num_blocks else 0.0


@dataclass(frozen=True)
class StepResult:
    """One engine step, as :meth:`LLMEngine.step_with_counts` reports it."""

    outputs: list[RequestOutput]
    new_tokens: dict[str, int]
    """The output tokens each request (by the id it was added with) gained, whatever its output
    kind (a FINAL_ONLY request has no output until it ends)."""
    events: list[SchedulingEvent]
    """The scheduler's events of this step, under the ids the requests were added with."""


def resolve_hub_ids(config: EngineConfig) -> EngineConfig:
    """``config`` with each Hub id (the model, ``--tokenizer``, the draft model of
    ``--speculative-config``) replaced by its local files, downloaded into ``--download-dir``.
    The tokenizer follows vLLM: ``--tokenizer-revision``, else ``--revision``; a
    ``--tokenizer-revision`` without ``--tokenizer`` takes the model repo's tokenizer at it."""
    changes: dict = {}
    if hub.is_hub_id(config.model):
        changes.update(model=hub.resolve(config.model, config.revision, config.download_dir, config.gguf_file),
                       revision=None, gguf_file=None)
    tok = config.tokenizer if config.tokenizer is not None else (
        config.model if config.tokenizer_revision is not None else None)
    if hub.is_hub_id(tok):
        changes.update(tokenizer=hub.resolve(tok, config.tokenizer_revision or config.revision, config.download_dir,
                                              kind="tokenizer", flag="--tokenizer"), tokenizer_revision=None)
    spec = config.speculative_config
    if spec is not None and hub.is_hub_id(spec.model):
        local = hub.resolve(spec.model, spec.revision, config.download_dir, flag="--speculative-config model")
        changes["speculative_config"] = dataclasses.replace(spec, model=local, revision=None)
    return dataclasses.replace(config, **changes) if changes else config


def check_processor_kwargs_family(kwargs: dict, vision, name: str) -> None:
    """``--mm-processor-kwargs`` is for a model whose image processor takes them (Qwen3.5's);
    elsewhere it would be silently ignored, so it is a ValueError (before the slow start)."""
    if kwargs and (vision is None or not isinstance(vision.cfg, qwen3_5_vl.VisionConfig)):
        what = "has no image processor" if vision is None else "has an image processor without min/max pixels"
        raise ValueError(f"--mm-processor-kwargs (mm_processor_kwargs) {sorted(kwargs)}: {name} {what} "
                         f"(only Qwen3.5's takes min_pixels / max_pixels)")


class LLMEngine:
    def __init__(self, config: EngineConfig, replica: int = 0):
        """``replica``: the data-parallel replica this engine is (it runs on that slice of the devices)."""
        distributed.initialize(config.parallel)   # before anything touches a device
        rc = config.runner
        if rc.cpu_matmul != "xla" or rc.attention_backend in ("auto", "native"):
            # The native CPU kernels' first build (~15 s of g++ on two cores) runs beside the loading.
            native.prefetch()
        # A Hub model id becomes its local files here, once (jaxllm/hub.py): the engine then
        # sees a local path, and the id stays the model's name (as vLLM reports it).
        hub_id = config.model if hub.is_hub_id(config.model) else None
        config = resolve_hub_ids(config)
        self.config = config
        model, self.tokenizer = self._load(config)
        self.model_name = hub_id or model.name
        self.arch = model.arch
        self.generation_config = dict(model.generation_config)
        check_processor_kwargs_family(config.mm_processor_kwargs, model.vision, self.model_name)
        self.eos_token_ids = eos_token_ids(self.tokenizer, self.arch.eos_token_ids, self.generation_config)
        # One grammar compiler (and its cache) for the input processor and the runner.
        self.grammar = None if self.tokenizer is None else GrammarCompiler(
            self.tokenizer, self.arch.vocab_size, self.eos_token_ids,
            config.structured_outputs_config.with_tag_resolved(self.tokenizer))
        self.core = EngineCore(config, model, replica=replica, grammar=self.grammar)
        # A vision-language model: images are preprocessed at the edge (the input processor).
        # The newline ids transformers' processor puts around each image come from the tokenizer
        # (none without one: a token-ids prompt then gets the image blocks alone).
        newlines = () if self.tokenizer is None or model.vision is None else newline_ids(
            lambda text: encode(self.tokenizer, text, add_special_tokens=False))
        if model.vision is None:
            images = None
        elif isinstance(model.vision.cfg, qwen3_5_vl.VisionConfig):
            images = QwenPromptImages(model.vision, config.mm_processor_kwargs)  # variable grids, M-RoPE positions
        else:
            images = PromptImages(model.vision, self.core.resolved.step.max_num_batched_tokens, newlines)
        self.supports_images = images is not None
        del model  # host copies of the weights are no longer needed
        return_freed_memory()
        self.max_model_len = self.core.resolved.step.max_model_len
        self.input_processor = InputProcessor(self.tokenizer, self.arch.vocab_size, self.max_model_len,
                                              self.eos_token_ids, config.runner.max_logprobs, grammar=self.grammar,
                                              lora_store=self.core.lora_store, images=images)
        self.output_processor = OutputProcessor(self.tokenizer)

    @staticmethod
    def _load(config: EngineConfig):
        """The checkpoint, then its tokenizer, each logged with its size and time.  (Not side
        by side: measured, a tokenizer thread slowed the weights' dequantization more than it saved.)"""
        t0 = time.perf_counter()
        log.info("loading weights of %s", config.model or BUILTIN_MODEL_NAME)
        model = load_model(config.model, dequantize=config.dequantize, quantization=config.quantization)
        log.info("loaded %d tensors, %.1f MiB, in %.1f s: %s", len(model.globals) + sum(len(lp) for lp in model.layers),
                 model.weight_bytes() / 2**20, time.perf_counter() - t0, model.formats())
        if config.skip_tokenizer_init:
            return model, None
        t0 = time.perf_counter()
        src = TokenizerSource(config.tokenizer) if config.tokenizer else model.tokenizer
        tok = load_tokenizer(src, default_cache_dir())
        log.info("tokenizer: %d tokens, in %.1f s", len(tok), time.perf_counter() - t0)
        return model, tok

    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams | None = None, *,
                    kind: OutputKind = OutputKind.CUMULATIVE, priority: int = 0,
                    lora_request: LoRARequest | None = None) -> None:
        """Validates and tokenizes the prompt (ValueError naming what is wrong), then queues it;
        ``lora_request``: its adapter (the engine needs ``enable_lora``)."""
        request = self.input_processor.process_inputs(request_id, prompt, params or SamplingParams(),
                                                      priority=priority, lora_request=lora_request)
        self.add_engine_request(request, kind)

    def add_engine_request(self, request: EngineRequest, kind: OutputKind = OutputKind.CUMULATIVE) -> None:
        """Queues a request the input processor made (not checked again).  ValueError when its
        id is in use by a request that has not ended."""
        seed = request.params.seed
        for i, cid in enumerate(self.output_processor.add_request(request, kind)):
            self.core.add_request(Request.from_engine_request(
                request, cid, self.core.new_seed() if seed is None else seed + i))

    def abort_request(self, request_ids) -> list[RequestOutput]:
        """Ends requests now (their KV blocks return to the pool); returns their final outputs,
        finish_reason "abort", for the requests that were still running."""
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        finals = []
        for rid in request_ids:
            self.core.abort_requests(self.output_processor.child_ids(rid))
            final = self.output_processor.abort(rid)
            if final is not None:
                finals.append(final)
        return finals

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()

    def remove_lora(self, lora_int_id: int) -> bool:
        """vLLM's: unloads adapter ``lora_int_id`` (engine/core.py); whether it was loaded."""
        return self.core.remove_lora(lora_int_id)

    def list_loras(self) -> set[int]:
        return self.core.list_loras()

    def get_stats(self) -> EngineStats:
        sched, kv = self.core.scheduler, self.core.kv_manager
        spec = sched.spec_stats
        return EngineStats(num_running=len(sched.running), num_waiting=len(sched.waiting),
                           num_free_blocks=kv.num_free_blocks, num_blocks=kv.num_blocks,
                           num_preemptions=sched.num_preemptions,
                           prefix_cache_queries=kv.prefix_cache_queries, prefix_cache_hits=kv.prefix_cache_hits,
                           spec_num_drafts=spec.num_drafts, spec_num_draft_tokens=spec.num_draft_tokens,
                           spec_num_accepted_tokens=spec.num_accepted_tokens,
                           spec_accepted_per_pos=tuple(spec.accepted_per_pos),
                           prompt_tokens_computed=sched.num_prompt_tokens_computed, block_size=kv.block_size,
                           **self._lora_stats(sched), **self._encoder_stats())

    def _encoder_stats(self) -> dict:
        """The encoder cache's fields of ``EngineStats`` (none without a vision encoder)."""
        vision = getattr(self.core.runner, "vision", None)
        if vision is None:
            return {}
        return {"encoder_cache_hits": vision.hits, "encoder_cache_misses": vision.misses,
                "encoder_cache_entries": len(vision.cache)}

    @staticmethod
    def _lora_stats(sched) -> dict:
        """The LoRA fields of ``EngineStats`` (none without LoRA: no walk over the queues per step)."""
        if sched.lora is None:
            return {}
        return {"max_loras": sched.lora.max_loras, "running_loras": _adapter_names(sched.running),
                "waiting_loras": _adapter_names(sched.waiting)}

    def compile_all(self) -> None:
        """Makes every step bucket's programs ready (a server calls it before serving), and the
        grammar compiler's view of the vocabulary (~1.5 s for 49k tokens), which the first
        structured-output request would otherwise wait for in the server's event loop."""
        self.core.compile_all()
        if self.grammar is not None:
            _ = self.grammar.tokenizer

    def step(self) -> list[RequestOutput]:
        return self.step_with_counts().outputs

    def step_with_counts(self) -> StepResult:
        """:meth:`step`, with each request's new token count and the step's scheduling events."""
        core = self.core.step()
        # Mapped before the output processor forgets the requests that finished in this step.
        parent = self.output_processor.parent_id
        events = [SchedulingEvent(parent(e.request_id), e.kind, e.timestamp) for e in core.events]
        outputs, to_abort, new_tokens = self.output_processor.process(core.outputs)
        if to_abort:
            self.core.abort_requests(to_abort)
        return StepResult(outputs, new_tokens, events)

    def follow(self) -> None:
        """On a host other than 0 of a multi-host engine: run host 0's steps until it stops."""
        self.core.follow()

    def shutdown(self) -> None:
        """Host 0 of a multi-host engine: release the other hosts (also done at exit)."""
        self.core.shutdown()
