"""Qwen3.5's image encoder on the device (``runner/vision.py``'s cache, guard and layout, this
family's programs).  Its images come in many grids (the processor keeps each image's aspect
ratio), so one program per grid cannot be compiled ahead of time.  The tower depends on the
grid only through host-computed arrays (``qwen3_5_vl.grid_inputs``: position taps, 2D rotary
angles, attention segments) and the patch count N, so an image runs padded to the first patch
bucket >= N (``qwen_image_processor.patch_buckets``: powers of two up to ``max_pixels``' patch
count, the checkpoint's with ``--mm-processor-kwargs`` over it and capped by default at
``DEFAULT_MAX_PATCHES``, as the edge's processor: a few programs, all compiled at start-up).
The padding patches form a segment of their own (no real patch attends to them) and their
rows are dropped.

Resizing every image to a fixed set of grids was the other way: fewer programs, but the
pixels and the token count would differ from the checkpoint's processor, so the outputs from
transformers'; padding costs at most 2x the encoder's work for an image and changes nothing.
The text model attends over an image's tokens causally (Qwen), so they need not share a step.
"""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.models.qwen3_5_vl import grid_inputs
from jaxllm.multimodal.qwen_image_processor import patch_buckets
from jaxllm.multimodal.qwen_prompt_images import processor_config
from jaxllm.runner.vision import VisionEncoder

log = logging.getLogger("jaxllm.runner")

MAX_DEFAULT_CACHE_TOKENS = 65536
"""Without a budget: 64 of the largest images' tokens, at most this many."""


class QwenVisionEncoder(VisionEncoder):
    bidirectional = False

    def __init__(self, module, weights, sharding, strict: bool, cache_tokens: int | None = None,
                 mm_processor_kwargs: dict | None = None):
        # patch counts, ascending; the edge (multimodal/qwen_prompt_images.py) resizes to the same config
        self.buckets = patch_buckets(processor_config(weights, mm_processor_kwargs))
        super().__init__(module, weights, sharding, strict, cache_tokens)

    def default_cache_tokens(self) -> int:
        return min(self.DEFAULT_CACHE_IMAGES * self.buckets[-1] // self.cfg.merge_unit, MAX_DEFAULT_CACHE_TOKENS)

    def compile(self) -> None:
        """Every patch bucket's program, compiled now (a server's start-up)."""
        for b in self.buckets:
            self._program(b)
        self.warm = True
        log.info("vision encoder: Qwen image grids padded to %s patches (up to %d tokens an image); encoder cache "
                 "budget %d tokens (%.1f MiB)", list(self.buckets), self.buckets[-1] // self.cfg.merge_unit,
                 self.cache_tokens, self.cache_tokens * self.cfg.out_hidden_size * 4 / 2**20)

    def _program(self, n: int):
        prog = self._programs.get(n)
        if prog is None:
            cfg, module = self.cfg, self.module
            rep = self._sharding
            inputs = {k: jax.ShapeDtypeStruct((n, *v.shape[1:]), v.dtype, sharding=rep)
                      for k, v in grid_inputs(cfg, [(1, cfg.spatial_merge_size, cfg.spatial_merge_size)]).items()}
            spec = jax.ShapeDtypeStruct((n, cfg.patch_dim), jnp.float32, sharding=rep)
            params = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), self.params)
            prog = self._programs[n] = jax.jit(lambda p, px, gi: module.encode(cfg, p, px, gi)).lower(
                params, spec, inputs).compile()
        return prog

    def run(self, pixels: np.ndarray, grid) -> np.ndarray:
        """patches [N, C*Tp*P*P] of one image of ``grid`` -> its rows [N / merge_unit, D]."""
        N = len(pixels)
        bucket = next((b for b in self.buckets if b >= N), None)
        if bucket is None:     # the input processor refuses these first
            raise ValueError(f"image of {N} patches: more than the vision encoder's largest bucket {self.buckets[-1]}")
        pad = bucket - N
        gi = grid_inputs(self.cfg, [grid])
        # padding patches: zero pixels in a segment of their own (-1; the image's is 0), so the
        # image's attention never sees them; cos 1 / sin 0 keep their rotary finite
        fill = {"interp_idx": 0, "interp_w": 0.0, "cos": 1.0, "sin": 0.0, "segment": -1}
        gi = {k: np.concatenate([v, np.full((pad, *v.shape[1:]), fill[k], v.dtype)]) for k, v in gi.items()}
        px = np.concatenate([np.asarray(pixels, np.float32), np.zeros((pad, self.cfg.patch_dim), np.float32)])
        rows = np.asarray(self._program(bucket)(self.params, px, gi))       # [bucket / merge_unit, D]
        return rows[:N // self.cfg.merge_unit]
