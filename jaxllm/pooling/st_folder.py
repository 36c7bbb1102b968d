"""The pooler a sentence-transformers folder declares: ``modules.json`` lists the modules, the
Pooling module's ``config.json`` (``1_Pooling/``) says CLS / MEAN / LAST, a ``Normalize``
module L2-normalizes.  Wrong pooling gives plausible, useless vectors, so a module or mode
this runner does not implement is refused by name rather than skipped."""

from __future__ import annotations

import json
import os

from jaxllm.errors import ModelLoadError
from jaxllm.pooling.config import PoolerConfig

# sentence-transformers' pooling modes (the one-string form of 5.x+ and the flag form before) -> ours.
_MODES = {"cls": "CLS", "mean": "MEAN", "lasttoken": "LAST"}
_FLAGS = {"pooling_mode_cls_token": "cls", "pooling_mode_mean_tokens": "mean", "pooling_mode_lasttoken": "lasttoken",
          "pooling_mode_max_tokens": "max", "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
          "pooling_mode_weightedmean_tokens": "weightedmean"}


def _read(path: str) -> dict | list:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"{path}: cannot read it ({e})") from None


def _mode(cfg: dict, where: str) -> str:
    if isinstance(cfg.get("pooling_mode"), str):
        mode = cfg["pooling_mode"]
    else:
        on = [m for flag, m in _FLAGS.items() if cfg.get(flag)]
        if len(on) != 1:
            raise ModelLoadError(f"{where}: expected exactly one pooling mode, got {on or 'none'}")
        mode = on[0]
    if mode not in _MODES:
        raise ModelLoadError(f"{where}: pooling mode {mode!r} is not supported (supported: "
                             f"{', '.join(_MODES)}); pass --pooler-config to choose another")
    return _MODES[mode]


def read_pooler_config(folder: str) -> PoolerConfig | None:
    """The folder's pooler, or None when it is not a sentence-transformers folder."""
    modules_path = os.path.join(folder, "modules.json")
    if not os.path.isfile(modules_path):
        return None
    modules = _read(modules_path)
    pooling_type, normalize = None, False
    for m in modules:
        kind = str(m.get("type", "")).rsplit(".", 1)[-1]
        if kind == "Transformer":
            continue
        if kind == "Pooling":
            where = os.path.join(folder, m.get("path", ""), "config.json")
            pooling_type = _mode(_read(where), where)
        elif kind == "Normalize":
            normalize = True
        else:
            raise ModelLoadError(f"{modules_path}: module {m.get('type')!r} is not supported "
                                 "(supported: Transformer, Pooling, Normalize)")
    if pooling_type is None:
        raise ModelLoadError(f"{modules_path}: no Pooling module")
    return PoolerConfig(pooling_type=pooling_type, normalize=normalize)


def max_seq_length(folder: str) -> int | None:
    """sentence-transformers' ``max_seq_length`` (``sentence_bert_config.json``), if it sets one."""
    path = os.path.join(folder, "sentence_bert_config.json")
    if not os.path.isfile(path):
        return None
    n = _read(path).get("max_seq_length")
    return int(n) if n else None
