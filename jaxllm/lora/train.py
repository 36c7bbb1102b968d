"""Training a LoRA in a notebook: the trainable pytree, its forward and loss, and saving it
as ``peft`` saves an adapter, so the engine (``LLM(enable_lora=True)`` + ``LoRARequest``) and
``peft.PeftModel.from_pretrained`` both load it.

    params, forward = functional.load()
    lora = init_lora(forward.arch, rank=8, alpha=16, key=jax.random.key(0))
    grads = jax.grad(loss)(lora, params, forward, tokens, mask)    # then any optax optimizer
    save_peft(lora, "my_adapter", base_model_name_or_path=forward.name)

The forward is ``jaxllm.functional``'s, with the delta added by the engine's own
``lora/apply.py`` (one slot, every token in slot 0), so what is trained is what is served.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np
from safetensors.numpy import save_file

from jaxllm.lora.apply import LoRAStep
from jaxllm.lora.peft import CONFIG_FILE, WEIGHTS_FILE
from jaxllm.lora.targets import lora_targets
from jaxllm.models.config import ArchConfig
from jaxllm.models.llama.params import PARAMS

ALL_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class LoRAParams:
    """The trainable adapter: ``weights[param] = {"A": [L, in, r], "B": [L, r, out]}`` float32
    (unscaled, as peft holds them, transposed to ``x @ A @ B``); the rest is static."""

    weights: dict
    rank: int = field(metadata=dict(static=True))
    alpha: float = field(metadata=dict(static=True))
    modules: tuple = field(metadata=dict(static=True))
    """(param, HF module pattern with ``{layer}``) per target, in ``weights``' order."""

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


def init_lora(arch: ArchConfig, rank: int, alpha: float, targets=ALL_LINEAR, *, key: jax.Array) -> LoRAParams:
    """A fresh adapter as peft initialises one: A ``kaiming_uniform(a=sqrt(5))`` (uniform in
    ``+-1/sqrt(in)``), B zeros, so the adapted model starts as the base.  ``targets``: PEFT
    module names (``q_proj``, ...; default every projection)."""
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ValueError(f"rank must be a positive integer, got {rank!r}")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or alpha <= 0:
        raise ValueError(f"alpha must be a positive number, got {alpha!r}")
    have = {t.short: t for t in lora_targets(PARAMS, arch).values()}
    targets = tuple(targets)
    lacking = [m for m in targets if m not in have or have[m].rows is not None]
    if not targets or lacking:
        raise ValueError(f"targets {lacking or list(targets)} are not unfused projections of this model "
                         f"(it has {sorted(m for m, t in have.items() if t.rows is None)})")
    weights, modules = {}, []
    for m, k in zip(targets, jax.random.split(key, len(targets))):
        t = have[m]
        bound = 1.0 / np.sqrt(t.in_size)
        A = jax.random.uniform(k, (arch.num_layers, t.in_size, rank), jnp.float32, -bound, bound)
        weights[t.param] = {"A": A, "B": jnp.zeros((arch.num_layers, rank, t.out_size), jnp.float32)}
        modules.append((t.param, t.module))
    return LoRAParams(weights, rank, float(alpha), tuple(modules))


def lora_step(lora: LoRAParams, num_tokens: int) -> LoRAStep:
    """The engine's per-step adapter input for ``num_tokens`` tokens all in one slot (slot 0)."""
    # the slots' layout, each A under its own key: [1, L, in, r], [1, L, r, out]
    w = {"A": {p: ab["A"][None] for p, ab in lora.weights.items()},
         "B": {p: (ab["B"] * lora.scale)[None] for p, ab in lora.weights.items()}}
    return LoRAStep(w, jnp.zeros((num_tokens,), jnp.int32))


def lora_logits(lora: LoRAParams, params: dict, forward, tokens: jax.Array) -> jax.Array:
    """tokens [B, L] -> float32 logits [B, L, V] of ``forward`` (``jaxllm.functional``'s) with the adapter."""
    tokens = jnp.asarray(tokens, jnp.int32)
    return forward(params, tokens, lora_step(lora, tokens.size))


def loss(lora: LoRAParams, params: dict, forward, tokens: jax.Array, mask: jax.Array) -> jax.Array:
    """Mean next-token cross-entropy over the tokens ``mask`` marks (the answer): tokens, mask
    [B, L]; position ``i``'s logits are scored against token ``i+1`` where ``mask[i+1]``."""
    logp = jax.nn.log_softmax(lora_logits(lora, params, forward, tokens)[:, :-1], axis=-1)   # [B, L-1, V]
    tokens = jnp.asarray(tokens, jnp.int32)
    nll = -jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]                  # [B, L-1]
    w = jnp.asarray(mask, jnp.float32)[:, 1:]
    return (nll * w).sum() / jnp.maximum(w.sum(), 1.0)


def save_peft(lora: LoRAParams, path: str, base_model_name_or_path: str | None = None) -> str:
    """Writes ``adapter_config.json`` + ``adapter_model.safetensors`` into folder ``path`` as
    ``peft``'s ``save_pretrained`` does (torch layout ``lora_A [r, in]``, ``lora_B [out, r]``,
    names ``base_model.model.<module>.lora_A.weight``); returns ``path``."""
    os.makedirs(path, exist_ok=True)
    tensors = {}
    for param, module in lora.modules:
        A = np.asarray(lora.weights[param]["A"], np.float32)          # [L, in, r]
        B = np.asarray(lora.weights[param]["B"], np.float32)          # [L, r, out]
        for layer in range(A.shape[0]):
            name = "base_model.model." + module.format(layer=layer)
            tensors[f"{name}.lora_A.weight"] = np.ascontiguousarray(A[layer].T)
            tensors[f"{name}.lora_B.weight"] = np.ascontiguousarray(B[layer].T)
    save_file(tensors, os.path.join(path, WEIGHTS_FILE), metadata={"format": "pt"})
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model_name_or_path,
        "r": lora.rank, "lora_alpha": lora.alpha, "lora_dropout": 0.0, "bias": "none",
        "target_modules": sorted(m.rsplit(".", 1)[-1] for _, m in lora.modules),
        "fan_in_fan_out": False, "inference_mode": True, "init_lora_weights": True, "use_rslora": False,
        "use_dora": False, "modules_to_save": None, "layers_to_transform": None, "layers_pattern": None,
        "rank_pattern": {}, "alpha_pattern": {}, "revision": None,
    }
    with open(os.path.join(path, CONFIG_FILE), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
    return path
