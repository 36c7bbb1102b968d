"""The two records of a request: ``EngineRequest`` (what the input processor made of it) and
``Request`` (the engine core's record of one sequence), each keyed by its request id.

An ``EngineRequest`` is validated and tokenized once, at the edge (``engine/processor.py``);
every layer after it trusts what it holds.  A request asking for ``n`` samples becomes ``n``
``Request``s, one per child id and seed, owned by the scheduler (pure Python, no JAX).  The
runner never sees either: it receives ``NewRequestData`` and per-step diffs (``outputs.py``).
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass

from jaxllm.lora.request import LoRARequest
from jaxllm.sampling_params import SamplingParams


@dataclass(frozen=True)
class ImageInput:
    """One image of a prompt, preprocessed at the edge (multimodal/prompt_images.py): what the
    runner's vision encoder takes, and where its embeddings go in the prompt."""

    pixels: object
    """float32 numpy, the checkpoint's processor output: [3, H, W] (Gemma 3), or the patch rows
    [N, C*Tp*P*P] of a Qwen image (its ``grid``)."""
    hash: str
    """sha256 of ``pixels``: keys the encoder cache and, through the cache salt, the prefix cache."""
    start: int
    """Prompt position of its first placeholder token."""
    length: int
    """Its placeholder tokens (one embedding row each).  Unless ``causal``, they attend to each
    other both ways: a prefill chunk never ends inside them (``Request.fit_images``)."""
    grid: tuple[int, int, int] | None = None
    """A Qwen image's patch grid (t, h, w) (``image_grid_thw``); None: a fixed-size image."""
    causal: bool = False
    """Its tokens attend causally like text (Qwen): a prefill chunk may end inside it."""


@dataclass(frozen=True)
class MRope:
    """A Qwen prompt's multimodal rotary positions (models/qwen3_5_vl/positions.py), computed
    once at the edge: the prompt's (t, h, w) positions, and the ``delta`` every later token adds
    to its sequence index in all three streams (transformers' ``rope_deltas``)."""

    positions: object
    """int32 numpy [3, P], P the prompt's length."""
    delta: int


@dataclass(frozen=True)
class EngineRequest:
    """A request as the input processor left it: valid for this engine, tokenized, resolved."""

    request_id: str
    prompt: str | None
    """The prompt text, when there is one (echo, and the RequestOutput's ``prompt``)."""
    prompt_token_ids: list[int]
    """Non-empty, in the vocabulary, and shorter than max_model_len (room for one output token)."""
    params: SamplingParams
    """The engine's copy: EOS ids and bad words' token ids filled in (shared read-only by the
    children of an n > 1 request)."""
    max_tokens: int
    """The output cap: ``params.max_tokens`` or what is left of max_model_len, whichever is smaller."""
    eos_token_ids: tuple[int, ...]
    priority: int = 0
    cache_salt: str | None = None
    """Non-empty when set: only requests with the same salt share cached prefix KV."""
    arrival_time: float = 0.0
    """``time.monotonic()`` when the request was processed."""
    lora_request: LoRARequest | None = None
    """The adapter it runs with (checked readable for this model), or None: the base model."""
    images: tuple[ImageInput, ...] = ()
    """Its images, in prompt order (a vision-language engine only)."""
    mrope: MRope | None = None
    """A Qwen prompt with images: its M-RoPE positions (None: positions are sequence indices)."""

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"

    @property
    def finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
                        RequestStatus.FINISHED_ABORTED)

    @property
    def finish_reason(self) -> str | None:
        return {RequestStatus.FINISHED_STOPPED: "stop", RequestStatus.FINISHED_LENGTH: "length",
                RequestStatus.FINISHED_ABORTED: "abort"}.get(self)


class Request:
    """One sequence: its prompt, its sampled tokens so far and how much of it has KV."""

    def __init__(self, request_id: str, prompt_token_ids: list[int], sampling_params: SamplingParams,
                 eos_token_ids: tuple[int, ...] = (), seed: int = 0, arrival_time: float | None = None,
                 priority: int = 0, max_tokens: int = 16, cache_salt: str | None = None,
                 lora_request: LoRARequest | None = None, images: tuple[ImageInput, ...] = (),
                 pooling: bool = False, mrope: MRope | None = None):
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_ids = tuple(eos_token_ids)
        self.seed = seed
        """The resolved 64-bit seed of the draw (the request's own or a random one)."""
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.priority = priority
        """Scheduling priority under ``--scheduling-policy priority``: lower runs first (vLLM's)."""
        self.cache_salt = cache_salt
        """Mixed into the prefix-cache hashes: only requests with the same salt share cached KV."""
        self.max_tokens = max_tokens
        """The resolved output cap (``max_tokens``, or what is left of ``max_model_len``)."""
        self.lora_request = lora_request
        """Its adapter, or None (the base model)."""
        self.images = images
        """Its images (``EngineRequest.images``)."""
        self.mrope = mrope
        """Its M-RoPE positions (``EngineRequest.mrope``)."""
        self.lora_slot = -1
        """The device slot of its adapter while it runs (the scheduler's), -1: none."""
        self.output_token_ids: list[int] = []
        self.num_computed_tokens = 0
        """Tokens whose K/V are in the cache."""
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.num_preemptions = 0
        self.num_cached_tokens: int | None = None
        """Prompt tokens served from the prefix cache when first scheduled (None before)."""
        self.block_hashes: list[bytes] = []
        """Chained prefix-cache hashes of the full blocks hashed so far (the KV manager's memo)."""
        self.arrival_seq = 0
        """Order of arrival at the scheduler (ties of every policy go to the earlier one)."""
        self.arrival_step = 0
        """The scheduler step at which it arrived (for the starvation guard)."""
        self.spec_token_ids: list[int] = []
        """Speculative decoding: tokens proposed after its last step, verified in its next one."""
        self.pooling = pooling
        """A pooling request (an embedder's or classifier's prompt): prefill-only, chunked like any
        prompt, ended at its last chunk with the runner's pooled row instead of a sampled token."""

    @classmethod
    def from_engine_request(cls, request: EngineRequest, child_id: str, seed: int) -> "Request":
        """Sample ``child_id`` of ``request``, drawing with ``seed``."""
        return cls(child_id, request.prompt_token_ids, request.params, eos_token_ids=request.eos_token_ids,
                   seed=seed, arrival_time=request.arrival_time, priority=request.priority,
                   max_tokens=request.max_tokens, cache_salt=request.cache_salt,
                   lora_request=request.lora_request, images=request.images, mrope=request.mrope)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    def fit_images(self, start: int, n: int) -> int:
        """Of ``n`` tokens from ``start``, how many one step may compute: a chunk that would end
        inside an image stops before it (its tokens attend to each other both ways, so one step
        holds all of them); 0 when it starts inside one it cannot finish."""
        end = start + n
        for im in self.images:
            if not im.causal and im.start < end < im.start + im.length:
                return max(im.start - start, 0)
        return n

    @property
    def lora_int_id(self) -> int:
        """Its adapter's id (0: the base model): keys its prefix-cache blocks."""
        return 0 if self.lora_request is None else self.lora_request.lora_int_id

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def skip_prefix_cache(self) -> bool:
        """A request that still has to deliver prompt logprobs computes its whole prompt
        (vLLM skips the cache for them too: cached positions produce no logits).  A pooling
        request neither reads nor fills the cache (vLLM disables prefix caching for pooling:
        MEAN pooling needs every token's hidden state, a cached block has none)."""
        return self.pooling or self.sampling_params.prompt_logprobs is not None and not self.output_token_ids

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, prompt={self.num_prompt_tokens}, "
                f"out={len(self.output_token_ids)}, computed={self.num_computed_tokens}, {self.status.value})")
