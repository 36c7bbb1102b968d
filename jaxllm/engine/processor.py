"""Input processing: a prompt and its parameters -> one validated, tokenized ``EngineRequest``.

This is the only place a request is checked against the engine (vocabulary, context length,
--max-logprobs, the tokenizer): the server, the offline ``LLM`` and the CLI all call
:meth:`InputProcessor.process_inputs`, and every layer after it (engine, output processor,
scheduler) trusts the ``EngineRequest`` it returns.  Checks that need only the parameters
are ``SamplingParams``' own.

One length rule (vLLM's): the prompt must leave room for at least one output token, so a
prompt of ``max_model_len`` tokens or more is refused; the output is capped at what is left of
the context (the one place that cap is applied), and ``min_tokens`` must fit under that cap.
"""

from __future__ import annotations

import copy
import time

from jaxllm.engine.tokenizer import encode
from jaxllm.lora.request import LoRARequest
from jaxllm.lora.store import AdapterStore
from jaxllm.multimodal.prompt_images import PromptImages, image_salt
from jaxllm.multimodal.qwen_prompt_images import QwenPromptImages
from jaxllm.request import EngineRequest
from jaxllm.sample.metadata import suppress_capacity_error
from jaxllm.sampling_params import SamplingParams
from jaxllm.structured.grammar import GrammarError

PromptType = str | dict | list
"""Text, token ids, or vLLM's prompt dict: ``prompt`` and/or ``prompt_token_ids`` (the ids win
when both are given), optionally ``cache_salt``."""


class InvalidRequestError(ValueError):
    """A request this engine cannot take; ``param`` names the offending input (``"prompt"``,
    ``"cache_salt"``, a SamplingParams field) so that a server can report it."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class InputProcessor:
    def __init__(self, tokenizer, vocab_size: int, max_model_len: int, eos_token_ids: tuple[int, ...],
                 max_logprobs: int, grammar=None, lora_store: AdapterStore | None = None,
                 images: PromptImages | QwenPromptImages | None = None):
        """``grammar``: the engine's structured-output compiler (structured/grammar.py), or None;
        ``lora_store``: where adapters are read (None: the engine runs without LoRA);
        ``images``: a vision-language model's image preprocessing (None: a text-only model)."""
        self.images = images
        self.lora_store = lora_store
        self.tokenizer = tokenizer
        self.grammar = grammar
        self.max_logprobs = max_logprobs
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids

    def process_inputs(self, request_id: str, prompt: PromptType, params: SamplingParams, *, priority: int = 0,
                       arrival_time: float | None = None, lora_request: LoRARequest | None = None) -> EngineRequest:
        """Validates and tokenizes one request.  Raises :class:`InvalidRequestError` (a
        ValueError) naming what is wrong; nothing is queued anywhere."""
        text, ids, salt = self._parse(prompt)
        images, mrope = (), None
        mm = prompt.get("multi_modal_data") if isinstance(prompt, dict) else None
        if mm:
            try:
                ids, images = self.images.process(ids, mm)
                mrope = self.images.mrope(ids, images)      # Qwen's M-RoPE positions, once (None: Gemma's)
            except ValueError as e:
                raise InvalidRequestError(str(e), "multi_modal_data") from None
            salt = image_salt(salt, images)
        self._check_prompt(ids)
        self._check_lora(lora_request)
        resolved = self.check_params(params)
        room = self.max_model_len - len(ids)
        max_tokens = room if resolved.max_tokens is None else min(resolved.max_tokens, room)
        if resolved.min_tokens > max_tokens:
            raise InvalidRequestError(f"min_tokens must be less than or equal to max_tokens={max_tokens} (what is "
                                      f"left of max_model_len={self.max_model_len} after the prompt), got "
                                      f"{resolved.min_tokens}.", "min_tokens")
        return EngineRequest(request_id, text, ids, resolved, max_tokens, self.eos_token_ids, priority=priority,
                             cache_salt=salt, lora_request=lora_request, images=images, mrope=mrope,
                             arrival_time=time.monotonic() if arrival_time is None else arrival_time)

    def _parse(self, prompt: PromptType) -> tuple[str | None, list[int], str | None]:
        """(prompt text or None, prompt token ids, cache salt or None)."""
        salt = None
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                text, ids = prompt.get("prompt"), prompt["prompt_token_ids"]
            elif "prompt" in prompt:
                text, ids = prompt["prompt"], None
            else:
                raise InvalidRequestError("a prompt dict needs 'prompt' or 'prompt_token_ids'", "prompt")
            if prompt.get("multi_modal_data") and self.images is None:
                # Would change the output: refused, never ignored.
                raise InvalidRequestError("multi_modal_data: this model takes no images (a text-only model)",
                                          "multi_modal_data")
            salt = prompt.get("cache_salt")
            if salt is not None and (not isinstance(salt, str) or not salt):
                raise InvalidRequestError("cache_salt must be a non-empty string if provided", "cache_salt")
        elif isinstance(prompt, str):
            text, ids = prompt, None
        elif isinstance(prompt, (list, tuple)):
            text, ids = None, prompt
        else:
            raise InvalidRequestError(f"a prompt must be a string, a list of token ids or a dict, got "
                                      f"{type(prompt).__name__}", "prompt")
        if ids is None:
            if not isinstance(text, str):
                raise InvalidRequestError("prompt must be a string", "prompt")
            if self.tokenizer is None:
                raise InvalidRequestError("this engine runs without a tokenizer (skip_tokenizer_init): pass "
                                          "prompt_token_ids", "prompt")
            ids = encode(self.tokenizer, text)
        return text, list(ids), salt

    def _check_lora(self, lora: LoRARequest | None) -> None:
        """Reads the adapter (kept in host memory for the runner): one this model cannot take is
        refused here, naming ``lora_path``."""
        if lora is None:
            return
        if not isinstance(lora, LoRARequest):
            raise InvalidRequestError(f"lora_request must be a LoRARequest, got {type(lora).__name__}", "lora_request")
        if self.lora_store is None:
            raise InvalidRequestError(f"lora_request {lora.lora_name!r}: this engine runs without LoRA (start it "
                                      f"with enable_lora=True / --enable-lora)", "lora_request")
        try:
            self.lora_store.get(lora)
        except ValueError as e:
            raise InvalidRequestError(str(e), "lora_path") from None

    def _check_prompt(self, ids: list[int]) -> None:
        if not ids:
            raise InvalidRequestError("The decoder prompt cannot be empty", "prompt")
        for t in ids:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < self.vocab_size:
                raise InvalidRequestError(f"prompt token id {t!r} is out of vocabulary (size {self.vocab_size})",
                                          "prompt")
        if len(ids) >= self.max_model_len:
            raise InvalidRequestError(
                f"The decoder prompt (length {len(ids)}) plus the number of requested output tokens (at least 1) "
                f"is longer than the maximum model length of {self.max_model_len}.", "prompt")

    def check_params(self, params: SamplingParams) -> SamplingParams:
        """Engine-dependent checks (vocabulary, --max-logprobs, the tokenizer for bad_words); the
        parameter-only checks are SamplingParams' own.  Raises InvalidRequestError naming the
        parameter.  Returns the resolved copy of ``params`` (see :meth:`resolve`)."""
        V = self.vocab_size
        if params.structured_outputs is not None:
            self._check_grammar(params)
        for t in params.stop_token_ids:
            if t >= V:
                raise InvalidRequestError(f"stop_token_ids contains {t}, outside the vocabulary (size {V})",
                                          "stop_token_ids")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(params, name)
            if k is not None and k > self.max_logprobs:
                raise InvalidRequestError(f"{name}={k} is more than the engine's max_logprobs={self.max_logprobs} "
                                          f"(--max-logprobs)", name)
        if params.logit_bias:
            bad = sorted(t for t in params.logit_bias if not 0 <= t < V)
            if bad:
                raise InvalidRequestError(f"logit_bias: token id(s) {bad} are out of vocabulary (size {V})",
                                          "logit_bias")
        if params.allowed_token_ids is not None:
            bad = sorted({t for t in params.allowed_token_ids if t >= V})
            if bad:
                raise InvalidRequestError(f"allowed_token_ids: token id(s) {bad} are out of vocabulary (size {V})",
                                          "allowed_token_ids")
        if params.bad_words and self.tokenizer is None:
            raise InvalidRequestError("bad_words needs a tokenizer (this engine runs with skip_tokenizer_init)",
                                      "bad_words")
        resolved = self.resolve(params)
        for seq in resolved.bad_words_token_ids or []:
            bad = [t for t in seq if not 0 <= t < V]
            if bad:
                raise InvalidRequestError(f"bad_words: token id(s) {bad} are out of vocabulary (size {V})",
                                          "bad_words")
        err = suppress_capacity_error(resolved)
        if err:
            raise InvalidRequestError(err, err.split(":", 1)[0])
        return resolved

    def _check_grammar(self, params: SamplingParams) -> None:
        """Compiles the constraint (cached for the runner), so that one that does not compile
        is refused here, before anything is queued."""
        if self.grammar is None:
            raise InvalidRequestError("structured_outputs needs a tokenizer (this engine runs with "
                                      "skip_tokenizer_init)", "structured_outputs")
        try:
            self.grammar.compile(params.structured_outputs)
        except GrammarError as e:
            raise InvalidRequestError(f"structured_outputs: {e}", "structured_outputs") from None

    def resolve(self, params: SamplingParams) -> SamplingParams:
        """A copy of ``params`` with the engine's EOS ids and the bad words' token ids filled in
        (the user's object is never changed: it may be shared by many prompts)."""
        params = copy.copy(params)
        params.update_from_eos(self.eos_token_ids)
        if params.bad_words and self.tokenizer is not None:
            params.update_from_tokenizer(self.tokenizer)
        return params
