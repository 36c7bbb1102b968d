"""The pooling runner's frozen configs: how hidden states become a vector (:class:`PoolerConfig`,
vLLM's ``--pooler-config`` shape) and the engine's sizes (:class:`PoolingEngineConfig`)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

POOLING_TYPES = ("CLS", "MEAN", "LAST", "ALL")
CONVERTS = ("auto", "none", "embed", "classify")


@dataclass(frozen=True)
class PoolerConfig:
    pooling_type: str = "MEAN"
    """CLS: the first token's hidden state; MEAN: the mean over the prompt's tokens; LAST: the last token's;
    ALL: every token's (vLLM's token embeddings: ``encode`` and ``/pooling`` only, one vector per token)."""
    normalize: bool = False
    """L2-normalize the pooled vector (sentence-transformers' ``Normalize`` module)."""
    dimensions: int | None = None
    """A Matryoshka model's default output size (vLLM's ``--pooler-config`` ``dimensions``): the
    pooled vector's first ``dimensions`` values, normalized after the cut; None: all of them."""

    def __post_init__(self):
        if self.pooling_type not in POOLING_TYPES:
            raise ValueError(f"--pooler-config pooling_type must be one of {', '.join(POOLING_TYPES)}, "
                             f"got {self.pooling_type!r}")
        if not isinstance(self.normalize, bool):
            raise ValueError(f"--pooler-config normalize must be true or false, got {self.normalize!r}")
        if self.dimensions is not None and (isinstance(self.dimensions, bool) or not isinstance(self.dimensions, int)
                                            or self.dimensions < 1):
            raise ValueError(f"--pooler-config dimensions must be a positive integer, got {self.dimensions!r}")

    def override(self, d: dict | None) -> "PoolerConfig":
        """This config with the fields of a ``--pooler-config`` dict (``pooling_type``, ``normalize``,
        ``dimensions``) replaced; any other key is a ValueError naming it."""
        if not d:
            return self
        if not isinstance(d, dict):
            raise ValueError(f"--pooler-config must be a JSON object, got {d!r}")
        unknown = sorted(set(d) - {"pooling_type", "normalize", "dimensions"})
        if unknown:
            raise ValueError(f"--pooler-config: unsupported key(s) {', '.join(unknown)} "
                             "(supported: pooling_type, normalize, dimensions)")
        kw = dict(d)
        if isinstance(kw.get("pooling_type"), str):
            kw["pooling_type"] = kw["pooling_type"].upper()
        return replace(self, **kw)


@dataclass(frozen=True)
class PoolingEngineConfig:
    model: str
    """An HF folder of an encoder (a sentence-transformers folder gives its pooler)."""
    pooler_config: dict = field(default_factory=dict)
    """``--pooler-config``: overrides the checkpoint's pooler (``pooling_type``, ``normalize``, ``dimensions``)."""
    max_model_len: int | None = None
    """The longest prompt; None: the checkpoint's positions (and sentence-transformers' ``max_seq_length``)."""
    max_num_batched_tokens: int = 1024
    """Tokens in one step: an encoder's prompt runs whole in one step, so also a cap on its length
    (a decoder's prompt is chunked: ``decoder_runner.py``)."""
    max_num_seqs: int = 64
    """Prompts in one step."""
    strict_compile_guard: bool = False
    """Fail a step that would trace or compile after its bucket was built (tests)."""
    precompile: str = "auto"
    """"all": build every bucket at start; "auto": a bucket the first time a step needs it."""
    compile_cache_dir: str | None = None
    """Persistent XLA compilation cache of an encoder's programs (``--compile-cache-dir``); None:
    ``$JAXLLM_CACHE_DIR/xla``, the generation engine's (a converted decoder runs in that engine)."""
    show_progress: bool = True
    convert: str = "auto"
    """vLLM's ``--convert``: "embed" / "classify" run a causal decoder as an embedder / classifier;
    "auto" converts a causal ``*ForSequenceClassification`` or sentence-transformers folder
    (``pooling/decoder.py``); "none": an encoder only."""
    hf_overrides: dict = field(default_factory=dict)
    """vLLM's ``--hf-overrides``: keys merged over the checkpoint's config.json (``architectures``,
    ``classifier_from_token``, ``method``, ``is_original_qwen3_reranker``, ...)."""
    attention_backend: str = "auto"
    """A decoder's kernels: auto (Pallas on a GPU, native on a CPU), native, xla or pallas."""
    async_scheduling: bool = True
    """A decoder's engine core (``--async-scheduling``, on by default as for generation): step N+1
    is scheduled and dispatched while step N runs; an encoder runs each batch whole (no effect)."""

    def __post_init__(self):
        for name in ("max_num_batched_tokens", "max_num_seqs"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"--max-model-len must be at least 1, got {self.max_model_len}")
        if self.precompile not in ("auto", "all"):
            raise ValueError(f"--precompile must be auto or all, got {self.precompile!r}")
        PoolerConfig().override(self.pooler_config)   # a bad key or value fails now
        if self.convert not in CONVERTS:
            raise ValueError(f"convert (--convert) must be one of {', '.join(CONVERTS)}, got {self.convert!r}")
        if not isinstance(self.hf_overrides, dict):
            raise ValueError(f"hf_overrides (--hf-overrides) must be a JSON object, got {self.hf_overrides!r}")
