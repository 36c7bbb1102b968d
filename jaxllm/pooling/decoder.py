"""A causal decoder as a pooling model (vLLM's ``--convert embed|classify``): which checkpoints
convert, how ``--hf-overrides`` rewrites their config, and their weights loaded for it.

vLLM's rules, followed here:

- ``convert="auto"`` converts without a flag a ``*ForSequenceClassification`` checkpoint of a
  causal family (classify), a sentence-transformers folder over a causal LM and a base
  ``*Model`` checkpoint (``Qwen3Model``, what sentence-transformers saves) (embed);
  ``runner="pooling"`` on any other causal LM embeds.
- An embedder pools the LAST token's final-norm hidden state and L2-normalizes it, unless the
  sentence-transformers folder says otherwise (``1_Pooling``, ``Normalize``).  The folder's
  instruction ``prompts`` (``config_sentence_transformers.json``) are not applied: vLLM leaves
  them to the caller, as sentence-transformers applies them only with ``prompt_name=``.
- A classifier is the ``score`` head ``[num_labels, D]`` (no bias) on the last token; or, from
  ``classifier_from_token`` (Qwen3-Reranker through ``--hf-overrides``), LM-head rows:
  ``from_2_way_softmax`` gives one label ``W[yes] - W[no]`` (its sigmoid is the softmax of the
  two logits), ``no_post_processing`` one label per token.  Such a model scores a text pair as
  the two texts concatenated (vLLM's ``use_pad_token`` false for an LLM used as a reranker); a
  ``*ForSequenceClassification`` checkpoint as the tokenizer's pair.

The pooling runner never computes vocabulary logits, so the LM head is not kept: the
architecture reads as tied (its parameter table then expects no ``lm_head``).
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass

import numpy as np

from jaxllm.errors import ModelLoadError
from jaxllm.layers.rotary import inv_frequencies
from jaxllm.models.loader import LoadedModel, NameMap, TokenizerSource, _assemble, _rope_tables, read_safetensors
from jaxllm.models.registry import get_family, read_config

CLASSIFIER_SUFFIX = "ForSequenceClassification"
BASE_SUFFIX = "Model"
CLASSIFIER_METHODS = ("from_2_way_softmax", "no_post_processing")
_HEAD = "score.weight"


def causal_name(architecture: str) -> str:
    """``Qwen3ForSequenceClassification`` and ``Qwen3Model`` (the base model sentence-transformers
    saves) -> ``Qwen3ForCausalLM``; other names unchanged."""
    for suffix in (CLASSIFIER_SUFFIX, BASE_SUFFIX):
        if architecture.endswith(suffix):
            return architecture[: -len(suffix)] + "ForCausalLM"
    return architecture


def read_hf_config(model: str | None, hf_overrides: dict | None = None) -> dict | None:
    """``model``'s config.json with ``hf_overrides`` merged over it; None when it is not an HF folder."""
    if model is None or not os.path.isfile(os.path.join(model, "config.json")):
        return None
    try:
        with open(os.path.join(model, "config.json")) as f:
            raw = json.load(f)
    except (OSError, ValueError):
        return None
    return {**raw, **(hf_overrides or {})}


def is_causal(architecture: str) -> bool:
    """A registered causal family (after mapping a ``*ForSequenceClassification`` name)."""
    try:
        return not get_family(causal_name(architecture)).pooling
    except ModelLoadError:
        return False


def default_convert(model: str | None, hf_overrides: dict | None) -> str:
    """vLLM's ``convert="auto"`` for ``model``: "classify" for a causal ``*ForSequenceClassification``,
    "embed" for a sentence-transformers folder over a causal LM, else "none"."""
    raw = read_hf_config(model, hf_overrides)
    archs = (raw or {}).get("architectures") or []
    if not archs or not is_causal(archs[0]):
        return "none"
    if archs[0].endswith(CLASSIFIER_SUFFIX):
        return "classify"
    if archs[0].endswith(BASE_SUFFIX) or os.path.isfile(os.path.join(model, "modules.json")):
        return "embed"
    return "none"


def check_hf_overrides(d) -> dict:
    if d is None:
        return {}
    if not isinstance(d, dict):
        raise ValueError(f"hf_overrides (--hf-overrides) must be a JSON object, got {d!r}")
    return dict(d)


@dataclass(frozen=True)
class DecoderCheckpoint:
    loaded: LoadedModel
    """The decoder's weights (no LM head) and its ``ArchConfig`` under the causal architecture."""
    architecture: str
    """The checkpoint's own architecture name (after ``--hf-overrides``)."""
    head: np.ndarray | None
    """float32 [num_labels, D]: the classifier on the last token; None: an embedder."""
    pair_as_text: bool
    """Score a pair as its two texts concatenated (an LLM as a reranker) rather than the
    tokenizer's pair encoding."""


def _classifier_from_tokens(raw: dict, lm_head: np.ndarray, model: str, where: str) -> np.ndarray:
    """The head built from LM-head rows of ``classifier_from_token`` (vLLM's two methods)."""
    from transformers import AutoTokenizer

    tokens = raw.get("classifier_from_token")
    method = raw.get("method") or ("from_2_way_softmax" if raw.get("is_original_qwen3_reranker") else None)
    if not isinstance(tokens, list) or not tokens or not all(isinstance(t, str) for t in tokens):
        raise ValueError(f"{where}: classifier_from_token must be a list of token strings, got {tokens!r}")
    if method not in CLASSIFIER_METHODS:
        raise ValueError(f"{where}: classifier_from_token needs method {' or '.join(CLASSIFIER_METHODS)} "
                         f"(or is_original_qwen3_reranker: true), got {method!r}")
    tok = AutoTokenizer.from_pretrained(model)
    ids = []
    for t in tokens:
        i = tok.convert_tokens_to_ids(t)
        if i is None or i == tok.unk_token_id or not 0 <= i < lm_head.shape[0]:
            raise ValueError(f"{where}: classifier_from_token {t!r} is not a token of the vocabulary")
        ids.append(int(i))
    w = np.asarray(lm_head, np.float32)
    if method == "from_2_way_softmax":
        if len(ids) != 2:
            raise ValueError(f"{where}: from_2_way_softmax takes two tokens (false, true), got {len(ids)}")
        return w[ids[1]][None] - w[ids[0]][None]             # [1, D]: sigmoid = softmax over the two
    return w[ids]                                           # [N, D]


def load_decoder(model: str, convert: str, hf_overrides: dict | None = None) -> DecoderCheckpoint:
    """``model`` (an HF folder of a causal family) loaded for ``convert`` ("embed" or "classify")."""
    where = os.path.join(model, "config.json")
    raw = read_hf_config(model, hf_overrides)
    if raw is None:
        raise ValueError(f"{model}: converting a decoder to pooling needs an HF folder with a config.json")
    archs = raw.get("architectures") or []
    if not archs:
        raise ModelLoadError(f"{where}: names no architecture")
    own = archs[0]
    causal = causal_name(own)
    family = get_family(causal)
    if family.pooling:
        raise ValueError(f"{own} is an encoder: convert applies to causal decoders")
    if family.allocate_cache is not None or family.per_sequence_state:
        raise ValueError(f"convert={convert!r}: {own} keeps its own cache layout or a state per sequence; the "
                         "pooling runner converts decoders with K/V pages in every layer (Llama family, Gemma, "
                         "GPT-OSS)")
    if raw.get("quantization_config"):
        raise ValueError(f"{model}: a quantized checkpoint cannot be converted to pooling (float weights only)")
    from transformers import AutoConfig
    try:
        hf = AutoConfig.from_pretrained(model)
    except Exception as e:  # transformers raises many types for a bad config
        raise ModelLoadError(f"{where}: transformers cannot read it ({e})") from None
    for k, v in (hf_overrides or {}).items():
        setattr(hf, k, v)
    hf.architectures = [causal]
    arch = read_config(hf, where)
    tensors: dict[str, tuple[np.ndarray, str]] = {}
    files = sorted(f for f in os.listdir(model) if f.endswith(".safetensors"))
    if not files:
        raise ModelLoadError(f"{model}: no *.safetensors weights")
    base = own.endswith(BASE_SUFFIX)
    for fname in files:
        for name, arr in read_safetensors(os.path.join(model, fname)).items():
            if name.endswith("rotary_emb.inv_freq"):
                continue
            if base and not name.startswith("model."):   # a base model's tensors are the causal LM's "model.*"
                name = "model." + name
            tensors[name] = (arr, fname)
    score = tensors.pop(_HEAD, None)
    lm_head = tensors.pop("lm_head.weight", None)
    head, pair_as_text = None, False
    if convert == "classify":
        if raw.get("classifier_from_token") is not None:
            rows = lm_head[0] if lm_head is not None else tensors["model.embed_tokens.weight"][0]
            head = _classifier_from_tokens(raw, rows, model, "hf_overrides" if hf_overrides else where)
            # vLLM: an LLM used as a reranker does not use the pad token: the pair is one text
            pair_as_text = not raw.get("use_pad_token", False)
        elif score is not None:
            head = np.asarray(score[0], np.float32)
            if head.ndim != 2 or head.shape[1] != arch.hidden_size:
                raise ModelLoadError(f"{where}: {_HEAD} has shape {head.shape}, expected [num_labels, "
                                     f"{arch.hidden_size}]")
            pair_as_text = raw.get("use_pad_token", True) is False
        else:
            raise ValueError(f"convert='classify': {model} has no {_HEAD} (a *ForSequenceClassification head) "
                             "and no classifier_from_token in its config or hf_overrides (--hf-overrides)")
    elif score is not None:
        raise ValueError(f"{model} is a classifier ({own}, {_HEAD}): it scores rather than embeds "
                         "(convert='classify', or leave convert='auto')")
    arch = dataclasses.replace(arch, tie_word_embeddings=True)
    layers, globals_ = _assemble(arch, tensors, NameMap(arch, "hf"), where=model)
    loaded = LoadedModel(name=model, arch=arch, layers=layers, globals=globals_,
                         rope_inv_freq=inv_frequencies(arch.rope_dim, arch.rope_theta, arch.rope_scaling),
                         tokenizer=TokenizerSource(model), rope_tables=_rope_tables(arch))
    return DecoderCheckpoint(loaded=loaded, architecture=own, head=head, pair_as_text=pair_as_text)


def pooling_convert(model: str | None, convert: str, hf_overrides: dict | None) -> str:
    """What the pooling runner makes of ``model``: "none" (an encoder, or not an HF folder),
    "embed" or "classify" (a causal decoder; ``convert="auto"``: classify for a
    ``*ForSequenceClassification``, else embed, vLLM's default under ``runner="pooling"``)."""
    raw = read_hf_config(model, hf_overrides)
    archs = (raw or {}).get("architectures") or []
    if not archs or not is_causal(archs[0]):
        if convert in ("embed", "classify"):
            raise ValueError(f"convert={convert!r} (--convert) turns a causal decoder (an HF folder) into a pooling "
                             f"model; {archs[0] if archs else model or 'the built-in model'} is not one")
        return "none"
    if convert == "auto":
        return "classify" if archs[0].endswith(CLASSIFIER_SUFFIX) else "embed"
    if convert == "none":
        raise ValueError(f"{archs[0]} is a causal decoder: the pooling runner takes it with convert='embed' or "
                         "'classify' (--convert)")
    return convert


def declared_prompts(model: str) -> dict:
    """The instruction prompts of ``config_sentence_transformers.json`` (``{"query": "Instruct: ..."}``)."""
    path = os.path.join(model, "config_sentence_transformers.json")
    try:
        with open(path) as f:
            prompts = json.load(f).get("prompts") or {}
    except (OSError, ValueError):
        return {}
    return {k: v for k, v in prompts.items() if v} if isinstance(prompts, dict) else {}
