"""The pooling engine: an encoder checkpoint (or a causal decoder converted to an embedder or a
classifier: ``decoder.py``), its tokenizer and pooler, and the runner.

Prompts (text or token ids) are tokenized and checked here, the one validation: an empty
prompt, an id outside the vocabulary, or a prompt longer than ``max_model_len`` (for an encoder,
which runs a prompt whole, also than a step: ``max_num_batched_tokens``; a decoder's prompt is
chunked) is a ValueError naming ``input``, before
anything runs.  ``truncate_prompt_tokens`` keeps a prompt's last k tokens (vLLM's rule).
"""

from __future__ import annotations

import logging
import os

import numpy as np

from jaxllm.engine.tokenizer import load_tokenizer
from jaxllm.errors import ModelLoadError
from jaxllm.models.loader import load_model
from jaxllm.models.registry import get_family
from jaxllm.paths import default_cache_dir
from jaxllm.pooling.config import CONVERTS, PoolerConfig, PoolingEngineConfig
from jaxllm.pooling.decoder import (check_hf_overrides, declared_prompts, default_convert, is_causal, load_decoder,
                                    pooling_convert, read_hf_config)
from jaxllm.pooling.decoder_runner import DecoderPoolingRunner, check_attention_backend
from jaxllm.pooling.heads import Matryoshka, class_probs, read_labels, truncate
from jaxllm.pooling.outputs import (ClassificationOutput, ClassificationRequestOutput, EmbeddingOutput,
                                    EmbeddingRequestOutput, PoolingOutput, PoolingRequestOutput, ScoringOutput,
                                    ScoringRequestOutput)
from jaxllm.pooling.params import PoolingParams
from jaxllm.pooling.runner import PoolingRunner
from jaxllm.pooling.st_folder import max_seq_length, read_pooler_config
from jaxllm.runner import compile as cc

log = logging.getLogger("jaxllm.engine")

RUNNERS = ("auto", "generate", "pooling")


class PoolingEngine:
    def __init__(self, config: PoolingEngineConfig):
        self.config = config
        self.model_name = config.model
        self.pair_as_text = False
        convert = pooling_convert(config.model, config.convert, config.hf_overrides)
        self.decoder = convert != "none"
        if self.decoder:
            self._init_decoder(config, convert)
        else:
            self._init_encoder(config)
        head = (f"a classifier ({self.num_labels} label(s))" if self.cross_encoder else
                f"{self.pooler.pooling_type} pooling" + (" + normalize" if self.pooler.normalize else ""))
        log.info("pooling runner: %s, %s, max_model_len %d, buckets %s", self.architecture, head,
                 self.max_model_len, self.runner.buckets)
        if config.precompile == "all":
            self.runner.compile_all()

    def _init_encoder(self, config: PoolingEngineConfig) -> None:
        if config.hf_overrides:
            raise ValueError("hf_overrides (--hf-overrides) applies to a converted decoder (convert), not an encoder")
        loaded = load_model(config.model)
        family = get_family(loaded.arch.architecture)
        # The generation engine's persistent program cache: a second start loads its programs.
        cc.enable_persistent_cache(config.compile_cache_dir or os.path.join(default_cache_dir(), "xla"))
        cc.install_listeners()
        if not family.pooling:
            raise ValueError(f"{config.model}: {loaded.arch.architecture} is a generative model; the pooling "
                             "runner serves encoders and HF folders of causal decoders (convert='embed'), "
                             "runner='generate' for this one")
        self.arch = loaded.arch
        self.architecture = loaded.arch.architecture
        self.num_labels = loaded.arch.encoder.num_labels
        self.tokenizer = load_tokenizer(loaded.tokenizer, default_cache_dir()) if loaded.tokenizer else None
        base = read_pooler_config(config.model) or PoolerConfig()
        self.pooler = base.override(config.pooler_config)
        positions = loaded.arch.max_position_embeddings - loaded.arch.encoder.position_offset
        self.max_model_len = self._model_len(config, positions)
        self.vocab_size = loaded.arch.vocab_size
        self._read_heads(config.model)
        self.runner = PoolingRunner(loaded.arch, family.module, {"globals": loaded.globals, "layers": loaded.layers},
                                    self.pooler, max_num_batched_tokens=config.max_num_batched_tokens,
                                    max_num_seqs=config.max_num_seqs,
                                    strict_compile_guard=config.strict_compile_guard,
                                    max_model_len=self.max_model_len)

    def _init_decoder(self, config: PoolingEngineConfig, convert: str) -> None:
        """A causal decoder converted to an embedder or a classifier (``pooling/decoder.py``)."""
        check_attention_backend(config.attention_backend)
        ckpt = load_decoder(config.model, convert, config.hf_overrides)
        loaded = ckpt.loaded
        self.arch = loaded.arch
        self.architecture = ckpt.architecture
        self.num_labels = 0 if ckpt.head is None else int(ckpt.head.shape[0])
        self.pair_as_text = ckpt.pair_as_text
        self.tokenizer = load_tokenizer(loaded.tokenizer, default_cache_dir())
        if self.num_labels:
            if config.pooler_config:
                raise ValueError("pooler_config (--pooler-config) applies to an embedder; a classifier reads the "
                                 "last token")
            self.pooler = PoolerConfig(pooling_type="LAST")
        else:
            # vLLM's default for a converted decoder: LAST + normalize, unless the folder says otherwise.
            base = read_pooler_config(config.model) or PoolerConfig(pooling_type="LAST", normalize=True)
            self.pooler = base.override(config.pooler_config)
            if self.pooler.pooling_type == "ALL":
                raise ValueError("--pooler-config pooling_type ALL is served for encoders; a converted decoder "
                                 "pools LAST or MEAN")
            prompts = declared_prompts(config.model)
            if prompts:
                log.info("the checkpoint declares instruction prompts (%s); as vLLM, they are not applied: "
                         "prepend them to the input yourself", ", ".join(sorted(prompts)))
        # Chunked like any prompt: a decoder's prompt may be longer than a step.
        self.max_model_len = self._model_len(config, loaded.arch.max_position_embeddings, chunked=True)
        self.vocab_size = loaded.arch.vocab_size
        self._read_heads(config.model)
        self.runner = DecoderPoolingRunner(loaded, self.pooler, ckpt.head, attention_backend=config.attention_backend,
                                           max_model_len=self.max_model_len,
                                           max_num_batched_tokens=config.max_num_batched_tokens,
                                           max_num_seqs=config.max_num_seqs,
                                           strict_compile_guard=config.strict_compile_guard,
                                           show_progress=config.show_progress,
                                           async_scheduling=config.async_scheduling,
                                           compile_cache_dir=config.compile_cache_dir)

    def _model_len(self, config: PoolingEngineConfig, positions: int, chunked: bool = False) -> int:
        """The longest prompt: the model's positions (or ``max_model_len``), and for an encoder,
        which runs a prompt whole, a step (``chunked``: a decoder's prompt is split in chunks)."""
        limit = min(n for n in (positions, max_seq_length(config.model)) if n)
        if config.max_model_len is not None and config.max_model_len > positions:
            raise ValueError(f"--max-model-len {config.max_model_len} is more than the model's {positions} positions")
        n = config.max_model_len or limit
        return n if chunked else min(n, config.max_num_batched_tokens)

    def _read_heads(self, folder: str) -> None:
        """The checkpoint's Matryoshka sizes (checked against ``--pooler-config`` ``dimensions``) and
        a classifier's labels."""
        self.matryoshka = Matryoshka.read(folder)
        if self.pooler.dimensions is not None:
            try:
                self.matryoshka.check(self.pooler.dimensions, self.arch.hidden_size, self.model_name)
            except ValueError as e:
                raise ValueError(f"--pooler-config dimensions: {e}") from None
        self.default_dimensions = self.pooler.dimensions or self.matryoshka.default
        self.labels = read_labels(folder, self.num_labels) if self.cross_encoder else []

    def output_dimensions(self, dimensions: int | None, model_name: str | None = None) -> int | None:
        """The size an embedding request gets: its ``dimensions`` (checked: a ValueError naming it),
        else the model's default (None: the whole vector)."""
        self.matryoshka.check(dimensions, self.arch.hidden_size, model_name or self.model_name)
        return dimensions if dimensions is not None else self.default_dimensions

    def finish_embedding(self, vec: np.ndarray, dimensions: int | None) -> np.ndarray:
        """A pooled vector [D] -> the embedding a request gets (cut to ``dimensions``, renormalized)."""
        return truncate(vec, dimensions, self.pooler.normalize)

    def check_classifier(self) -> None:
        if not self.cross_encoder:
            raise ValueError(f"{self.architecture} is an embedding model: it embeds texts (embed(), "
                             "/v1/embeddings) rather than classifying them (classify() and /classify need a "
                             "*ForSequenceClassification checkpoint)")

    def pooled_data(self, row: np.ndarray, dimensions: int | None) -> np.ndarray:
        """One step row -> what ``encode`` and ``/pooling`` return: a classifier's probabilities, an
        embedder's embedding."""
        return class_probs(row) if self.cross_encoder else self.finish_embedding(row, dimensions)

    def _run(self, prompts, truncate_prompt_tokens: int | None) -> tuple[list[list[int]], list[np.ndarray]]:
        """One prompt or a list (texts or token-id lists) -> (checked token ids, one step row per
        prompt); every prompt is checked before any runs."""
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts
                                                 and isinstance(prompts[0], (int, np.integer))):
            prompts = [prompts]
        texts = [p for p in prompts if isinstance(p, str)]
        if len(texts) > 1 and self.tokenizer is not None:
            # One call for the texts: a fast tokenizer encodes them in parallel (256 texts of 128
            # tokens: 80 ms against 155 one by one); checked as token ids below.
            encoded = iter(self.tokenizer(texts)["input_ids"])
            prompts = [list(next(encoded)) if isinstance(p, str) else p for p in prompts]
        ids = [self.tokenize(p, truncate_prompt_tokens, index=i) for i, p in enumerate(prompts)]
        return ids, self.embed_ids(ids)

    def classify(self, prompts, truncate_prompt_tokens: int | None = None) -> list[ClassificationRequestOutput]:
        """vLLM's ``LLM.classify``: texts or token-id lists -> the classifier's probabilities."""
        self.check_classifier()
        ids, rows = self._run(prompts, truncate_prompt_tokens)
        return [ClassificationRequestOutput(request_id=str(i), outputs=ClassificationOutput(class_probs(r).tolist()),
                                            prompt_token_ids=p) for i, (p, r) in enumerate(zip(ids, rows))]

    def encode(self, prompts, truncate_prompt_tokens: int | None = None,
               pooling_params: PoolingParams | None = None) -> list[PoolingRequestOutput]:
        """vLLM's ``LLM.encode``: texts or token-id lists -> the pooler's output (``pooled_data``)."""
        dims = self.output_dimensions((pooling_params or PoolingParams()).dimensions)
        ids, rows = self._run(prompts, truncate_prompt_tokens)
        return [PoolingRequestOutput(request_id=str(i), outputs=PoolingOutput(self.pooled_data(r, dims).tolist()),
                                     prompt_token_ids=p) for i, (p, r) in enumerate(zip(ids, rows))]

    @property
    def hidden_size(self) -> int:
        return self.arch.hidden_size

    @property
    def cross_encoder(self) -> bool:
        """A ``*ForSequenceClassification`` checkpoint (or a converted classifier): it scores text
        pairs, it does not embed."""
        return self.num_labels > 0

    def check_embedder(self) -> None:
        if self.pooler.pooling_type == "ALL" and not self.cross_encoder:
            raise ValueError("pooling_type ALL gives one vector per token, not an embedding: use encode() or "
                             "POST /pooling (or a --pooler-config pooling_type of CLS, MEAN or LAST)")
        if self.cross_encoder:
            raise ValueError(f"{self.architecture} is a cross-encoder: it scores text pairs (score(), /score, "
                             "/rerank) and classifies texts (classify(), /classify) rather than embedding them")

    def tokenize(self, prompt, truncate_prompt_tokens: int | None = None, *, index: int | None = None) -> list[int]:
        """A string or a list of token ids -> checked token ids (ValueError naming ``input``)."""
        where = "input" if index is None else f"input[{index}]"
        if isinstance(prompt, dict):
            prompt = prompt.get("prompt_token_ids", prompt.get("prompt"))
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"{where}: text needs a tokenizer; send token ids")
            ids = list(self.tokenizer.encode(prompt))
        elif isinstance(prompt, (list, tuple)) and all(isinstance(t, (int, np.integer)) for t in prompt):
            ids = [int(t) for t in prompt]
        else:
            raise ValueError(f"{where} must be a string or a list of token ids")
        k = self._keep(truncate_prompt_tokens)
        if k is not None:   # vLLM's rule: the last k tokens
            ids = ids[-k:]
        if not ids:
            raise ValueError(f"{where} is empty")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"{where}: token id {bad[0]} is out of vocabulary (size {self.vocab_size})")
        self._check_length(ids, where)
        return ids

    def _keep(self, truncate_prompt_tokens: int | None) -> int | None:
        """How many tokens ``truncate_prompt_tokens`` keeps (-1: as many as fit), or None."""
        if truncate_prompt_tokens is None:
            return None
        if truncate_prompt_tokens == 0 or truncate_prompt_tokens < -1:
            raise ValueError(f"truncate_prompt_tokens must be -1 or at least 1, got {truncate_prompt_tokens}")
        return self.max_model_len if truncate_prompt_tokens == -1 else truncate_prompt_tokens

    def _check_length(self, ids: list[int], where: str) -> None:
        if len(ids) > self.max_model_len:
            raise ValueError(f"{where} has {len(ids)} tokens, more than the maximum of {self.max_model_len} "
                             "(max_model_len; an encoder runs a prompt whole in a step); shorten it or set "
                             "truncate_prompt_tokens")

    def tokenize_pair(self, first: str, second: str, truncate_prompt_tokens: int | None = None, *,
                      where: str = "input") -> tuple[list[int], list[int]]:
        """A cross-encoder's (query, document) -> (token ids, token types): ``[CLS] q [SEP] d [SEP]``,
        the document's tokens of type 1; ``truncate_prompt_tokens`` cuts the document's end."""
        if not isinstance(first, str) or not isinstance(second, str):
            raise ValueError(f"{where}: a pair is two strings")
        if self.decoder:
            return self._decoder_pair(first, second, truncate_prompt_tokens, where)
        enc = self.tokenizer(first, second)
        ids, types = list(enc["input_ids"]), list(enc.get("token_type_ids") or [0] * len(enc["input_ids"]))
        k = self._keep(truncate_prompt_tokens)
        if k is not None:
            if len(ids) > k:   # keep the query whole, cut the document (its last token stays [SEP])
                ids, types = ids[:k - 1] + ids[-1:], types[:k - 1] + types[-1:]
        self._check_length(ids, where)
        return ids, types

    def _decoder_pair(self, first: str, second: str, truncate_prompt_tokens: int | None,
                      where: str) -> tuple[list[int], list[int]]:
        """A decoder classifier's pair: the two texts as one (an LLM as a reranker: vLLM's
        ``use_pad_token`` false), else the tokenizer's pair encoding; ``truncate_prompt_tokens``
        keeps the first k tokens (the tokenizer's right-side truncation)."""
        enc = self.tokenizer(first + second) if self.pair_as_text else self.tokenizer(first, second)
        ids = list(enc["input_ids"])
        k = self._keep(truncate_prompt_tokens)
        if k is not None:
            ids = ids[:k]
        if not ids:
            raise ValueError(f"{where} is empty")
        self._check_length(ids, where)
        return ids, [0] * len(ids)

    def embed_ids(self, prompts: list[list[int]], token_types: list[list[int]] | None = None) -> list[np.ndarray]:
        """Checked token-id lists -> one float32 row each (a vector; a cross-encoder's logits)."""
        return self.runner.run(prompts, token_types)

    def pair_scores(self, logits: list[np.ndarray]) -> list[float]:
        """A cross-encoder's logits [1] per pair -> relevance scores (the sigmoid, as
        sentence-transformers' CrossEncoder and vLLM apply to one label)."""
        if self.num_labels != 1:
            raise ValueError(f"scoring needs a cross-encoder with one label; this one has {self.num_labels}")
        return [float(1.0 / (1.0 + np.exp(-np.float64(x[0])))) for x in logits]

    def score(self, text_1, text_2, truncate_prompt_tokens: int | None = None) -> list[ScoringRequestOutput]:
        """vLLM's ``LLM.score``: one text against N (1 -> N) or N against N (pairwise); a
        cross-encoder's relevance, an embedder's cosine similarity."""
        pairs = score_pairs(text_1, text_2)
        if self.cross_encoder:
            tok = [self.tokenize_pair(a, b, truncate_prompt_tokens, where=f"pair {i}") for i, (a, b) in enumerate(pairs)]
            scores = self.pair_scores(self.embed_ids([t[0] for t in tok], [t[1] for t in tok]))
            ids = [t[0] for t in tok]
        else:
            self.check_embedder()   # cosine of two embeddings: not of ALL pooling's token vectors
            left = [self.tokenize(a, truncate_prompt_tokens, index=i) for i, (a, _) in enumerate(pairs)]
            right = [self.tokenize(b, truncate_prompt_tokens, index=i) for i, (_, b) in enumerate(pairs)]
            vecs = self.embed_ids(left + right)
            scores = [cosine(vecs[i], vecs[len(pairs) + i]) for i in range(len(pairs))]
            ids = [a + b for a, b in zip(left, right)]
        return [ScoringRequestOutput(request_id=str(i), outputs=ScoringOutput(s), prompt_token_ids=p)
                for i, (s, p) in enumerate(zip(scores, ids))]

    def embed(self, prompts, truncate_prompt_tokens: int | None = None,
              pooling_params: PoolingParams | None = None) -> list[EmbeddingRequestOutput]:
        """Texts or token-id lists -> ``EmbeddingRequestOutput``s in order; every prompt is checked
        before any runs; ``pooling_params.dimensions``: a Matryoshka model's output size."""
        self.check_embedder()
        dims = self.output_dimensions((pooling_params or PoolingParams()).dimensions)
        ids, vecs = self._run(prompts, truncate_prompt_tokens)
        return [EmbeddingRequestOutput(request_id=str(i), prompt_token_ids=p,
                                       outputs=EmbeddingOutput(self.finish_embedding(v, dims).tolist()))
                for i, (p, v) in enumerate(zip(ids, vecs))]


def score_pairs(text_1, text_2) -> list[tuple]:
    """vLLM's pairing: a single first text against each second one, or the two lists pairwise."""
    left = [text_1] if isinstance(text_1, str) else list(text_1)
    right = [text_2] if isinstance(text_2, str) else list(text_2)
    if not left or not right:
        raise ValueError("scoring needs at least one text on each side")
    if len(left) == 1:
        left = left * len(right)
    if len(left) != len(right):
        raise ValueError(f"scoring pairs {len(left)} first texts with {len(right)} second texts: give one first "
                         "text or as many as second texts")
    return list(zip(left, right))


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    a64, b64 = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(a64 @ b64 / max(np.linalg.norm(a64) * np.linalg.norm(b64), 1e-12))


def is_pooling_checkpoint(model: str | None, hf_overrides: dict | None = None) -> bool:
    """Whether ``model`` (an HF folder) is an encoder the pooling runner serves (``runner="auto"``)."""
    raw = read_hf_config(model, hf_overrides)
    try:
        archs = (raw or {}).get("architectures") or []
        return bool(archs) and get_family(archs[0]).pooling
    except (OSError, ValueError, ModelLoadError):
        return False


def uses_pooling_runner(model: str | None, runner: str, pooler_config: dict | None, convert: str = "auto",
                        hf_overrides: dict | None = None) -> bool:
    """Whether ``runner`` (with ``"auto"``: the checkpoint, and ``convert``) asks for the pooling
    runner.  ``"auto"`` picks it for an encoder, a causal ``*ForSequenceClassification``, a
    sentence-transformers folder over a causal LM (vLLM's rules) or an explicit ``convert``."""
    if runner not in RUNNERS:
        raise ValueError(f"runner (--runner) must be one of {', '.join(RUNNERS)}, got {runner!r}")
    if convert not in CONVERTS:
        raise ValueError(f"convert (--convert) must be one of {', '.join(CONVERTS)}, got {convert!r}")
    hf_overrides = check_hf_overrides(hf_overrides)
    encoder = is_pooling_checkpoint(model, hf_overrides)
    auto = default_convert(model, hf_overrides)
    if runner == "generate":
        if encoder:
            raise ValueError(f"{model} is an encoder: it embeds rather than generates (runner='pooling')")
        if auto == "classify":
            raise ValueError(f"{model} is a classifier (*ForSequenceClassification): it scores rather than "
                             "generates (runner='pooling')")
        if convert in ("embed", "classify"):
            raise ValueError(f"convert={convert!r} (--convert) needs runner='pooling' (--runner pooling)")
    elif runner == "pooling" and not encoder:
        raw = read_hf_config(model, hf_overrides)
        archs = (raw or {}).get("architectures") or []
        if not archs or not is_causal(archs[0]):
            raise ValueError(f"runner='pooling' needs an encoder checkpoint (BertModel, ...) or an HF folder of a "
                             f"causal decoder (convert='embed'); {model or 'the built-in model'} is neither")
    pooling = runner == "pooling" or (runner == "auto" and (encoder or auto != "none"
                                                            or convert in ("embed", "classify")))
    if pooler_config and not pooling:
        raise ValueError("pooler_config (--pooler-config) applies to the pooling runner only")
    if hf_overrides and not pooling:
        raise ValueError("hf_overrides (--hf-overrides) applies to the pooling runner only")
    return pooling
