"""Reads a LoRA adapter as ``peft`` saves it (``adapter_config.json`` +
``adapter_model.safetensors``) into float32 arrays per target projection, or refuses it with a
ValueError naming what this engine does not take.

The scale (``lora_alpha / r``, or ``lora_alpha / sqrt(r)`` with ``use_rslora``) is folded into
``B``; a layer the file does not cover has zeros (``layers_to_transform``).
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass

import numpy as np
from jaxllm.lora.targets import Target, modules
from jaxllm.models.loader import read_safetensors

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"


@dataclass(frozen=True)
class LoRAWeights:
    """One adapter read for one model: ``weights[param] = (A [L, in, r], B [L, r, out])``
    float32, the scale folded into B; only the targets the adapter changes."""

    path: str
    rank: int
    scale: float
    weights: dict[str, tuple[np.ndarray, np.ndarray]]


def _refuse(path: str, what: str) -> ValueError:
    return ValueError(f"LoRA adapter at lora_path={path!r}: {what}")


def read_config(path: str) -> dict:
    if not os.path.isdir(path):
        raise _refuse(path, "no such folder")
    cfile = os.path.join(path, CONFIG_FILE)
    if not os.path.isfile(cfile):
        raise _refuse(path, f"{CONFIG_FILE} is missing")
    try:
        with open(cfile, encoding="utf-8") as f:
            cfg = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise _refuse(path, f"{CONFIG_FILE} is not valid JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise _refuse(path, f"{CONFIG_FILE} is not a JSON object")
    return cfg


def _check_config(path: str, cfg: dict, targets: dict[str, Target], max_rank: int) -> tuple[int, float]:
    """(rank, scale) of a config this engine takes."""
    kind = cfg.get("peft_type", "LORA")
    if kind != "LORA":
        raise _refuse(path, f"peft_type {kind!r} is not LORA")
    if cfg.get("use_dora"):
        raise _refuse(path, "use_dora: DoRA adapters are not supported")
    if cfg.get("modules_to_save"):
        raise _refuse(path, f"modules_to_save {cfg['modules_to_save']!r} is not supported (the adapter replaces "
                            f"whole modules)")
    for key in ("rank_pattern", "alpha_pattern"):
        if cfg.get(key):
            raise _refuse(path, f"{key} (per-module ranks or alphas) is not supported")
    if cfg.get("bias", "none") != "none":
        raise _refuse(path, f"bias={cfg['bias']!r}: trained biases are not supported (only bias='none')")
    r, alpha = cfg.get("r"), cfg.get("lora_alpha")
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise _refuse(path, f"r must be a positive integer, got {r!r}")
    if r > max_rank:
        raise _refuse(path, f"rank r={r} is above max_lora_rank={max_rank} (--max-lora-rank)")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
        raise _refuse(path, f"lora_alpha must be a number, got {alpha!r}")
    by_module = modules(targets)
    wanted = cfg.get("target_modules")
    if isinstance(wanted, list):
        lacking = [m for m in wanted if m not in by_module]
        if lacking:
            raise _refuse(path, f"target_modules {lacking} are not projections this model has "
                                f"(it has {sorted(by_module)})")
    elif not isinstance(wanted, str):
        raise _refuse(path, f"target_modules must be a list of names or a string, got {wanted!r}")
    scale = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
    return r, float(scale)


def _module_matchers(targets: dict[str, Target]) -> list[tuple[re.Pattern, list[Target]]]:
    by: dict[str, list[Target]] = {}
    for t in targets.values():
        by.setdefault(t.module, []).append(t)
    return [(re.compile(re.escape(m).replace(re.escape("{layer}"), r"(\d+)") + r"$"), ts) for m, ts in by.items()]


def read_adapter(path: str, targets: dict[str, Target], num_layers: int, max_rank: int) -> LoRAWeights:
    """The adapter in folder ``path`` for a model with ``targets`` (lora/targets.py) and
    ``num_layers`` layers.  Raises ValueError naming ``lora_path`` and what is wrong."""
    cfg = read_config(path)
    r, scale = _check_config(path, cfg, targets, max_rank)
    wfile = os.path.join(path, WEIGHTS_FILE)
    if not os.path.isfile(wfile):
        raise _refuse(path, f"{WEIGHTS_FILE} is missing")
    try:
        tensors = read_safetensors(wfile)
    except Exception as e:   # ModelLoadError, or an OSError reading it
        raise _refuse(path, f"{WEIGHTS_FILE} cannot be read ({e})") from None
    matchers = _module_matchers(targets)
    weights: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    seen = set()
    for key, a in tensors.items():
        m = re.fullmatch(r"(?:base_model\.model\.)?(.+)\.lora_([AB])(?:\.[^.]+)?\.weight", key)
        if m is None:
            raise _refuse(path, f"tensor {key!r} is not a LoRA A/B matrix of a linear projection (not supported)")
        module, which = m.group(1), m.group(2)
        for pattern, ts in matchers:
            hit = pattern.match(module)
            if hit:
                break
        else:
            raise _refuse(path, f"tensor {key!r}: module {module!r} is not a projection this model has "
                                f"(LoRA targets: {sorted({t.short for t in targets.values()})})")
        layer = int(hit.group(1))
        if not 0 <= layer < num_layers:
            raise _refuse(path, f"tensor {key!r}: layer {layer} is outside the model's {num_layers} layers")
        a = np.asarray(a, np.float32)
        for t in ts:
            want = (r, t.in_size) if which == "A" else ((t.rows[1] if t.rows else t.out_size), r)
            if a.shape != want:
                raise _refuse(path, f"tensor {key!r} has shape {list(a.shape)}, expected {list(want)}")
            A, B = weights.setdefault(t.param, (np.zeros((num_layers, t.in_size, r), np.float32),
                                                np.zeros((num_layers, r, t.out_size), np.float32)))
            if which == "A":
                A[layer] = a.T
            else:
                rows = a if t.rows is None else a[t.rows[0]:t.rows[0] + t.out_size]
                B[layer] = rows.T * np.float32(scale)
            seen.add((t.param, layer, which))
    for param, layer, which in seen:
        if (param, layer, "B" if which == "A" else "A") not in seen:
            raise _refuse(path, f"layer {layer}'s {targets[param].short} has lora_{which} but not its pair")
    if not weights:
        raise _refuse(path, f"{WEIGHTS_FILE} holds no LoRA weights")
    return LoRAWeights(path, r, scale, weights)
