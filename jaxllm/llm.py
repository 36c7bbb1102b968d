"""The offline API for scripts and notebooks, shaped like vLLM's ``LLM`` class.

    from jaxllm import LLM, SamplingParams
    llm = LLM()                                   # the built-in SmolLM2-135M-Instruct
    outs = llm.generate(["Hello"], SamplingParams(max_tokens=32))
    print(outs[0].outputs[0].text)
"""

from __future__ import annotations

import itertools

from tqdm import tqdm

from jaxllm import console
from jaxllm.config import DEFAULT_MM_LIMIT, EngineConfig, check_mm_limits
from jaxllm.engine.llm_engine import LLMEngine
from jaxllm.engine.output_processor import OutputKind
from jaxllm.engine.render import render_chat_prompt
from jaxllm.lora.request import LoRARequest
from jaxllm.multimodal.chat_parts import check_image_count, load, split_images
from jaxllm.multimodal.media import MediaLimits
from jaxllm.outputs import RequestOutput
from jaxllm.pooling.config import PoolingEngineConfig
from jaxllm.pooling.engine import PoolingEngine, uses_pooling_runner
from jaxllm.pooling.outputs import (ClassificationRequestOutput, EmbeddingRequestOutput, PoolingRequestOutput,
                                    ScoringRequestOutput)
from jaxllm.pooling.params import PoolingParams
from jaxllm.sampling_params import SamplingParams

# The engine arguments the pooling runner takes (the rest size a KV cache or a sampler it has not).
_POOLING_ARGS = ("max_model_len", "max_num_batched_tokens", "max_num_seqs", "strict_compile_guard", "precompile",
                 "compile_cache_dir", "show_progress", "attention_backend", "async_scheduling")


def _refuse_data_parallel(config: EngineConfig) -> None:
    if config.parallel.data_parallel_size > 1:
        raise ValueError(f"data_parallel_size={config.parallel.data_parallel_size}: data parallelism is a server "
                         f"feature (`jaxllm serve -dp N`); the offline LLM runs one engine "
                         f"(tensor_parallel_size spreads it over devices)")


class LLM:
    """An engine in this process.  Keyword arguments are the engine arguments (``max_num_seqs``,
    ``max_model_len``, ``dtype``, ``kv_cache_memory_bytes``, ``kv_cache_dtype``, ``block_size``, ...; vLLM's
    ``num_gpu_blocks_override`` too).  A step bucket is compiled (or loaded from the cache)
    the first time a step needs it; ``precompile="all"`` builds every bucket up front."""

    def __init__(self, model: str | None = None, *, runner: str = "auto", pooler_config: dict | None = None,
                 convert: str = "auto", hf_overrides: dict | None = None, limit_mm_per_prompt: dict | None = None,
                 allowed_local_media_path: str | None = None, **engine_args):
        """``runner``: "generate", "pooling" (an encoder: :meth:`embed`) or "auto" (pooling for an
        encoder checkpoint); ``pooler_config``: vLLM's ``--pooler-config`` (``pooling_type``,
        ``normalize``, ``dimensions``) over the checkpoint's pooler; ``convert``: "embed" / "classify" run a causal
        decoder as an embedder / classifier ("auto": a ``*ForSequenceClassification`` or a
        sentence-transformers folder converts by itself); ``hf_overrides``: keys merged over the
        checkpoint's config.json (Qwen3-Reranker's ``classifier_from_token``), pooling runner only;
        ``limit_mm_per_prompt`` (``{"image": N}``, default 999) and ``allowed_local_media_path``:
        vLLM's, for :meth:`chat`'s image parts (jaxllm/multimodal/chat_parts.py)."""
        # Checked before the (slow) engine start.
        check_mm_limits(limit_mm_per_prompt or {})
        self._image_limit = (limit_mm_per_prompt or {}).get("image", DEFAULT_MM_LIMIT)
        self._media = MediaLimits(allowed_local_media_path=allowed_local_media_path)
        # The start-up phases as `jaxllm serve` logs them, unless the program set up logging itself.
        self.llm_engine = self.pooling_engine = None
        self._ids = itertools.count()
        if uses_pooling_runner(model, runner, pooler_config, convert, hf_overrides):
            other = sorted(k for k in engine_args if k not in _POOLING_ARGS and not (k == "dtype" and
                                                                                     engine_args[k] in ("auto", "float32")))
            if other:
                raise ValueError(f"runner='pooling' does not take {', '.join(other)} (it takes "
                                 f"{', '.join(_POOLING_ARGS)}; dtype float32)")
            console.install_default_handler()
            self.pooling_engine = PoolingEngine(PoolingEngineConfig(
                model=model, pooler_config=dict(pooler_config or {}), convert=convert,
                hf_overrides=dict(hf_overrides or {}), **{k: v for k, v in engine_args.items() if k in _POOLING_ARGS}))
            return
        config = EngineConfig.from_kwargs(model=model, **engine_args)
        _refuse_data_parallel(config)
        console.install_default_handler()
        self.llm_engine = LLMEngine(config)

    @classmethod
    def from_engine_config(cls, config: EngineConfig) -> "LLM":
        _refuse_data_parallel(config)
        console.install_default_handler()
        llm = cls.__new__(cls)
        llm.llm_engine, llm.pooling_engine = LLMEngine(config), None
        llm._ids = itertools.count()
        llm._image_limit, llm._media = DEFAULT_MM_LIMIT, MediaLimits()
        return llm

    def get_tokenizer(self):
        return (self.pooling_engine or self.llm_engine).tokenizer

    def embed(self, prompts, *, truncate_prompt_tokens: int | None = None, use_tqdm: bool = True,
              pooling_params: PoolingParams | None = None) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt (a string, a list of token ids, or a list of either), in
        order: ``out.outputs.embedding``; ``pooling_params=PoolingParams(dimensions=d)`` cuts a
        Matryoshka model's embeddings to d values.  Needs the pooling runner."""
        if self.pooling_engine is None:
            raise ValueError("embed() needs a pooling model: LLM(model, runner='pooling') on an encoder checkpoint; "
                             "this LLM generates (use generate() or chat())")
        return self.pooling_engine.embed(prompts, truncate_prompt_tokens, pooling_params)

    def classify(self, prompts, *, truncate_prompt_tokens: int | None = None,
                 use_tqdm: bool = True) -> list[ClassificationRequestOutput]:
        """vLLM's ``LLM.classify``: a classifier's (``*ForSequenceClassification``) probabilities per
        prompt, in order: ``out.outputs.probs`` (the softmax of its logits; one label: the sigmoid)."""
        if self.pooling_engine is None:
            raise ValueError("classify() needs a pooling model: LLM(model, runner='pooling') on a "
                             "*ForSequenceClassification checkpoint; this LLM generates")
        return self.pooling_engine.classify(prompts, truncate_prompt_tokens)

    def encode(self, prompts, *, truncate_prompt_tokens: int | None = None, use_tqdm: bool = True,
               pooling_params: PoolingParams | None = None) -> list[PoolingRequestOutput]:
        """vLLM's ``LLM.encode``: the pooler's raw output per prompt, ``out.outputs.data`` (an
        embedder's embedding, with pooling_type ALL one vector per prompt token, a classifier's
        probabilities)."""
        if self.pooling_engine is None:
            raise ValueError("encode() needs a pooling model: LLM(model, runner='pooling') on an encoder checkpoint; "
                             "this LLM generates (use generate() or chat())")
        return self.pooling_engine.encode(prompts, truncate_prompt_tokens, pooling_params)

    def score(self, text_1, text_2, *, truncate_prompt_tokens: int | None = None,
              use_tqdm: bool = True) -> list[ScoringRequestOutput]:
        """vLLM's ``LLM.score``: ``text_1`` (one text, or a list) against ``text_2`` (one or N texts;
        1 -> N or pairwise): ``out.outputs.score``, a cross-encoder's relevance or an embedder's
        cosine similarity.  Needs the pooling runner."""
        if self.pooling_engine is None:
            raise ValueError("score() needs a pooling model: LLM(model, runner='pooling') on an encoder or "
                             "cross-encoder checkpoint; this LLM generates")
        return self.pooling_engine.score(text_1, text_2, truncate_prompt_tokens)

    def _refuse_pooling(self, method: str) -> None:
        if self.pooling_engine is not None:
            raise ValueError(f"{method}() is for generative models; this LLM runs the pooling runner "
                             f"({self.pooling_engine.architecture}): use embed()")

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None, *,
                 use_tqdm: bool = True, priority: list[int] | None = None,
                 lora_request: LoRARequest | list[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """Runs every prompt to completion (continuously batched); outputs come back in prompt order.

        A prompt is a string, a list of token ids, or a dict with ``prompt`` or
        ``prompt_token_ids`` and optionally ``cache_salt`` (only prompts with the same salt
        share cached prefix KV).  ``priority``: one per prompt, for ``scheduling_policy="priority"``
        (lower runs first).  ``lora_request``: the adapter every prompt runs with, or one per
        prompt (None: the base model); the engine needs ``enable_lora=True``."""
        self._refuse_pooling("generate")
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} sampling params for {len(prompts)} prompts")
        if priority is not None and len(priority) != len(prompts):
            raise ValueError(f"got {len(priority)} priorities for {len(prompts)} prompts")
        loras = lora_request if isinstance(lora_request, list) else [lora_request] * len(prompts)
        if len(loras) != len(prompts):
            raise ValueError(f"got {len(loras)} lora requests for {len(prompts)} prompts")
        engine = self.llm_engine
        if engine.core.is_follower:
            raise ValueError("this host (--host-index > 0) follows host 0's steps: call llm.follow() here and "
                             "generate on host 0 (docs/scale-out.md)")
        # Every prompt is validated before any is queued: a bad one leaves nothing behind.
        requests = [engine.input_processor.process_inputs(str(next(self._ids)), p, sp,
                                                          priority=0 if priority is None else priority[i],
                                                          lora_request=loras[i])
                    for i, (p, sp) in enumerate(zip(prompts, params))]
        for r in requests:
            engine.add_engine_request(r, OutputKind.FINAL_ONLY)
        return self._run([r.request_id for r in requests], use_tqdm)

    def chat(self, messages, sampling_params: SamplingParams | list[SamplingParams] | None = None, *,
             use_tqdm: bool = True, chat_template: str | None = None, add_generation_prompt: bool = True,
             chat_template_kwargs: dict | None = None,
             lora_request: LoRARequest | list[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """One conversation (a list of messages) or several (a list of lists), via the chat template."""
        self._refuse_pooling("chat")
        tok = self.get_tokenizer()
        if tok is None:
            raise ValueError("chat needs a tokenizer (the engine was built with skip_tokenizer_init)")
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = []
        for conv in convs:
            conv, found = split_images(conv)
            check_image_count([f for f, _ in found], supports_images=bool(getattr(self.llm_engine, "supports_images",
                                                                                   False)),
                              limit=self._image_limit, model=self.llm_engine.model_name)
            prompt = render_chat_prompt(tok, conv, add_generation_prompt=add_generation_prompt,
                                        chat_template=chat_template,
                                        chat_template_kwargs=chat_template_kwargs).engine_prompt()
            if found:  # vLLM's engine input for an image prompt
                prompt["multi_modal_data"] = {"image": [load(f, src, self._media) for f, src in found]}
            prompts.append(prompt)
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm, lora_request=lora_request)

    def follow(self) -> None:
        """Multi-host, on every host but 0: run host 0's steps; returns once host 0 calls
        :meth:`shutdown` (or exits)."""
        self.llm_engine.follow()

    def shutdown(self) -> None:
        """Multi-host, on host 0: release the other hosts from :meth:`follow`.  A no-op on one host."""
        self.llm_engine.shutdown()

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        done: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm and console.bars_allowed():
            bar = tqdm(total=len(ids), desc="Processed prompts", unit="req")
        try:
            while len(done) < len(ids) and engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        done[out.request_id] = out
                        if bar is not None:
                            bar.update(1)
        except BaseException:
            engine.abort_request([i for i in ids if i not in done])
            raise
        finally:
            if bar is not None:
                bar.close()
        return [done[i] for i in ids]
