"""Input processing: prompts (text, token ids, or vLLM's prompt dicts) -> validated engine requests."""

from __future__ import annotations

import copy

from jaxllm.engine.tokenizer import encode
from jaxllm.request import Request
from jaxllm.sample.metadata import suppress_capacity_error
from jaxllm.sampling_params import SamplingParams

PromptType = str | dict | list


class InputProcessor:
    def __init__(self, tokenizer, vocab_size: int, max_model_len: int, eos_token_ids: tuple[int, ...],
                 max_logprobs: int):
        self.tokenizer = tokenizer
        self.max_logprobs = max_logprobs
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids

    def tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """Returns (prompt text or None, prompt token ids), validated."""
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                text, ids = prompt.get("prompt"), prompt["prompt_token_ids"]
            elif "prompt" in prompt:
                text, ids = prompt["prompt"], None
            else:
                raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        elif isinstance(prompt, str):
            text, ids = prompt, None
        elif isinstance(prompt, (list, tuple)):
            text, ids = None, list(prompt)
        else:
            raise ValueError(f"a prompt must be a string, a list of token ids or a dict, got {type(prompt).__name__}")
        if ids is None:
            if not isinstance(text, str):
                raise ValueError("prompt must be a string")
            if self.tokenizer is None:
                raise ValueError("this engine runs without a tokenizer (skip_tokenizer_init): pass prompt_token_ids")
            ids = encode(self.tokenizer, text)
        ids = list(ids)
        if not ids:
            raise ValueError("The decoder prompt cannot be empty")
        for t in ids:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < self.vocab_size:
                raise ValueError(f"prompt token id {t!r} is out of vocabulary (size {self.vocab_size})")
        if len(ids) > self.max_model_len:
            raise ValueError(f"The decoder prompt (length {len(ids)}) is longer than the maximum model length "
                             f"of {self.max_model_len}.")
        return text, ids

    @staticmethod
    def cache_salt(prompt: PromptType) -> str | None:
        """A dict prompt's ``cache_salt`` (vLLM's): requests share cached prefix KV only with
        requests of the same salt.  None when absent; a non-empty string otherwise."""
        if not isinstance(prompt, dict) or prompt.get("cache_salt") is None:
            return None
        salt = prompt["cache_salt"]
        if not isinstance(salt, str) or not salt:
            raise ValueError("cache_salt must be a non-empty string if provided")
        return salt

    def check_params(self, params: SamplingParams) -> SamplingParams:
        """Engine-dependent checks (vocabulary, --max-logprobs, the tokenizer for bad_words); the
        parameter-only checks are SamplingParams' own.  Raises ValueError naming the parameter.
        Returns the resolved copy of ``params`` (see :meth:`resolve`) that requests are made of."""
        V = self.vocab_size
        for t in params.stop_token_ids:
            if t >= V:
                raise ValueError(f"stop_token_ids contains {t}, outside the vocabulary (size {V})")
        if params.logprobs is not None and params.logprobs > self.max_logprobs:
            raise ValueError(f"logprobs={params.logprobs} is more than the engine's max_logprobs="
                             f"{self.max_logprobs} (--max-logprobs)")
        if params.prompt_logprobs is not None and params.prompt_logprobs > self.max_logprobs:
            raise ValueError(f"prompt_logprobs={params.prompt_logprobs} is more than the engine's max_logprobs="
                             f"{self.max_logprobs} (--max-logprobs)")
        if params.logit_bias:
            bad = sorted(t for t in params.logit_bias if not 0 <= t < V)
            if bad:
                raise ValueError(f"logit_bias: token id(s) {bad} are out of vocabulary (size {V})")
        if params.allowed_token_ids is not None:
            bad = sorted({t for t in params.allowed_token_ids if t >= V})
            if bad:
                raise ValueError(f"allowed_token_ids: token id(s) {bad} are out of vocabulary (size {V})")
        if params.bad_words and self.tokenizer is None:
            raise ValueError("bad_words needs a tokenizer (this engine runs with skip_tokenizer_init)")
        resolved = self.resolve(params)
        for seq in resolved.bad_words_token_ids or []:
            bad = [t for t in seq if not 0 <= t < V]
            if bad:
                raise ValueError(f"bad_words: token id(s) {bad} are out of vocabulary (size {V})")
        err = suppress_capacity_error(resolved)
        if err:
            raise ValueError(err)
        return resolved

    def resolve(self, params: SamplingParams) -> SamplingParams:
        """A copy of ``params`` with the engine's EOS ids and the bad words' token ids filled in
        (the user's object is never changed: it may be shared by many prompts)."""
        params = copy.copy(params)
        params.update_from_eos(self.eos_token_ids)
        if params.bad_words and self.tokenizer is not None:
            params.update_from_tokenizer(self.tokenizer)
        return params

    def make_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, seed: int,
                     priority: int = 0, arrival_time: float | None = None, cache_salt: str | None = None) -> Request:
        """``params``: as returned by :meth:`check_params` (resolved, shared read-only by the
        children of an n > 1 request)."""
        room = max(self.max_model_len - len(prompt_token_ids), 1)
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        return Request(request_id, prompt_token_ids, params, eos_token_ids=self.eos_token_ids, seed=seed,
                       arrival_time=arrival_time, priority=priority, max_tokens=max_tokens, cache_salt=cache_salt)

