"""Tokenizer loading (HF folders and GGUF metadata) and prompt encoding, including chat templates.

Converting a GGUF vocabulary into a fast tokenizer takes transformers about ten seconds,
so the converted tokenizer is saved once under the cache folder and reloaded from there.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile

from jaxllm.errors import ModelLoadError
from jaxllm.models.loader import TokenizerSource


def _gguf_cache_dir(src: TokenizerSource, cache_root: str) -> str:
    path = os.path.abspath(os.path.join(src.path, src.gguf_file))
    st = os.stat(path)
    key = hashlib.sha1(f"{path}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:16]
    return os.path.join(cache_root, "tokenizers", key)


def load_tokenizer(src: TokenizerSource, cache_root: str):
    from transformers import AutoTokenizer

    try:
        if src.gguf_file is None:
            return AutoTokenizer.from_pretrained(src.path)
        cached = _gguf_cache_dir(src, cache_root)
        if os.path.isfile(os.path.join(cached, "tokenizer.json")):
            return AutoTokenizer.from_pretrained(cached)
        tok = AutoTokenizer.from_pretrained(src.path, gguf_file=src.gguf_file)
        os.makedirs(os.path.dirname(cached), exist_ok=True)
        tmp = tempfile.mkdtemp(dir=os.path.dirname(cached))
        tok.save_pretrained(tmp)
        try:
            os.rename(tmp, cached)
        except OSError:  # another process got there first
            shutil.rmtree(tmp, ignore_errors=True)
        return tok
    except ModelLoadError:
        raise
    except Exception as e:
        where = src.path if src.gguf_file is None else os.path.join(src.path, src.gguf_file)
        raise ModelLoadError(f"{where}: cannot load the tokenizer ({type(e).__name__}: {e})") from None


def eos_token_ids(tokenizer, arch_eos: tuple[int, ...], generation_config: dict) -> tuple[int, ...]:
    """EOS ids: the tokenizer's, the checkpoint's and generation_config.json's, in that order."""
    ids: list[int] = []
    gen = generation_config.get("eos_token_id")
    gen = [gen] if isinstance(gen, int) else list(gen or [])
    tok = [tokenizer.eos_token_id] if tokenizer is not None and tokenizer.eos_token_id is not None else []
    for t in tok + list(arch_eos) + gen:
        if t not in ids:
            ids.append(int(t))
    return tuple(ids)


def render_chat(tokenizer, messages: list[dict], *, add_generation_prompt: bool = True,
                chat_template: str | None = None, chat_template_kwargs: dict | None = None) -> str:
    if chat_template is None and not getattr(tokenizer, "chat_template", None):
        raise ValueError("the tokenizer has no chat template; pass chat_template")
    try:
        return tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt,
            chat_template=chat_template, **(chat_template_kwargs or {}))
    except Exception as e:  # jinja errors, bad message shapes
        raise ValueError(f"cannot apply the chat template: {e}") from None


def encode(tokenizer, text: str, add_special_tokens: bool = True) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=add_special_tokens)
