"""Tokenizer loading (HF folders and GGUF metadata) and prompt encoding (chat templates: render.py).

A GGUF file's vocabulary is turned into a fast tokenizer by ``jaxllm.engine.gguf_tokenizer``
(torch-free; transformers' own GGUF reader needs torch).  Building it (the BPE merges) takes
several times longer than reading a saved one, so the converted tokenizer is saved once under
the cache folder and reloaded from there.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile

from jaxllm import cache_files
from jaxllm.errors import ModelLoadError
from jaxllm.models.loader import TokenizerSource


def _gguf_cache_dir(src: TokenizerSource, cache_root: str) -> str:
    # Imported here, inside load_tokenizer's try: the converter needs the optional-at-runtime
    # gguf / tokenizers packages, and a missing one must be a ModelLoadError naming it.
    from jaxllm.engine.gguf_tokenizer import CONVERTER_VERSION

    path = os.path.abspath(os.path.join(src.path, src.gguf_file))
    st = os.stat(path)
    # The converter version keeps tokenizers written by another converter (or an older one) apart.
    key = hashlib.sha1(f"{CONVERTER_VERSION}:{path}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:16]
    return os.path.join(cache_root, "tokenizers", key)


def _load_cached(folder: str):
    """The tokenizer saved in ``folder``, or None when the folder is damaged, truncated or
    foreign (then it is removed, with one log line, and the caller converts it again)."""
    from transformers import PreTrainedTokenizerFast

    problem = cache_files.folder_problem(folder)
    if problem is None:
        try:
            return PreTrainedTokenizerFast.from_pretrained(folder)
        except Exception as e:  # sealed but unreadable: another transformers' format
            problem = f"{type(e).__name__}: {e}"
    cache_files.discard(folder, problem, "converting the tokenizer again")
    return None


def load_tokenizer(src: TokenizerSource, cache_root: str):
    where = src.path if src.gguf_file is None else os.path.join(src.path, src.gguf_file)
    try:
        # The imports sit inside the try: a package that is missing (gguf, tokenizers,
        # transformers) becomes a ModelLoadError naming it (tests/models/test_gguf_tokenizer.py).
        if src.gguf_file is None:
            from transformers import AutoTokenizer
            return AutoTokenizer.from_pretrained(src.path)
        from jaxllm.engine.gguf_tokenizer import tokenizer_from_gguf
        cached = _gguf_cache_dir(src, cache_root)
        if os.path.isdir(cached):
            loaded = _load_cached(cached)
            if loaded is not None:
                return loaded
        tok = tokenizer_from_gguf(where)
        os.makedirs(os.path.dirname(cached), exist_ok=True)
        tmp = tempfile.mkdtemp(dir=os.path.dirname(cached))
        tok.save_pretrained(tmp)
        cache_files.seal_folder(tmp)   # sealed before the rename: the folder appears whole or not at all
        try:
            os.rename(tmp, cached)
        except OSError:  # another process got there first
            shutil.rmtree(tmp, ignore_errors=True)
        return tok
    except ModelLoadError:
        raise
    except ImportError as e:  # ModuleNotFoundError too: name the package, not the internals that wanted it
        package = (e.name or "").split(".")[0]
        if package:
            raise ModelLoadError(f"{where}: cannot load the tokenizer: the Python package {package!r} is missing or "
                                 f"cannot be imported ({e}); install it with `pip install {package}`") from None
        raise ModelLoadError(f"{where}: cannot load the tokenizer ({type(e).__name__}: {e})") from None
    except Exception as e:
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


def encode(tokenizer, text: str, add_special_tokens: bool = True) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=add_special_tokens)
