"""A vision-language model's image encoder on the device: the vision tower + projector
(``Family.vision.encode``) as its own program, compiled ahead of time per image size (Gemma 3
resizes every image to one size: one program; Qwen3.5's grids: ``runner/qwen_vision.py``), and each request's image rows laid out for the
step (``runner/inputs.py`` puts them at the placeholder tokens).

An encoder cache keyed by the image's pixel hash keeps the rows of recently used images within
a budget of ``cache_tokens`` encoder tokens (rows of [D] float32; ``--mm-encoder-cache-tokens``,
vLLM's ``encoder_cache_size`` is in the same unit), evicting the least recently used image first:
the same image again is not encoded again (``hits`` / ``misses`` count it; 0 tokens: no cache).
A preempted request's recompute asks again and is served from it while its image is still there.

Under tensor parallelism (a mesh of several devices) the encoder's weights split as the text
model's do, vLLM's ``--mm-encoder-tp-mode weights`` (its default; ``data``, every device a whole
copy and the images split between them, is not built: this encoder runs one image a call):
attention by heads, the MLP (and Qwen's patch merger) column- then row-parallel, the rules of
``parallel/sharding.vision_rules`` on the family's ``PARAM_AXES``.  Each device holds and computes
1/tp of the tower; the pixels go in and the rows come out whole on every device.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.errors import CompileGuardError
from jaxllm.parallel import sharding as psh
from jaxllm.runner import compile as cc

log = logging.getLogger("jaxllm.runner")


@dataclass(frozen=True)
class RequestImages:
    """One request's images, encoded, by prompt position."""

    row: np.ndarray       # [P] int32: each prompt position's row of ``embeds``, -1 for a text token
    visible: np.ndarray   # [P] int32: the last position each prompt token's query sees (its image's end)
    embeds: np.ndarray    # [N, D] float32: the image tokens' embeddings, in prompt order


class VisionEncoder:
    """``module``: the family's vision module (models/gemma3_vl/); ``weights``: its
    ``VisionWeights``; ``sharding``: where the encoder's inputs and outputs live (replicated
    over the runner's mesh; the parameters split over it when it has several devices).
    Gemma 3's encoder; Qwen3.5's (variable grids) is ``runner/qwen_vision.py``'s subclass."""

    DEFAULT_CACHE_IMAGES = 64
    """Without a budget: room for this many images' tokens."""
    bidirectional = True
    """An image's tokens see each other both ways in the text model (Gemma 3)."""

    def __init__(self, module, weights, sharding, strict: bool, cache_tokens: int | None = None):
        self.module, self.cfg, self.strict = module, weights.cfg, strict
        params = module.load_params(weights.cfg, weights.tensors)
        mesh = getattr(sharding, "mesh", None)
        tp = 1 if mesh is None else mesh.devices.size
        self.rules = psh.vision_rules(module.split_sizes(weights.cfg), tp) if tp > 1 else {}
        if tp == 1:
            self.params = jax.device_put(params, sharding)
        else:
            params = module.tp_layout(params, self.rules.get(psh.VISION_HEADS) is not None)
            specs = psh.param_specs(params, self.rules, module.PARAM_AXES, tp)
            self.params = jax.device_put(params, psh.named(mesh, specs))
            split = [axis for axis, mesh_axis in self.rules.items() if mesh_axis is not None]
            log.info("vision encoder: weights split over %d devices by %s (vLLM's mm_encoder_tp_mode weights)", tp,
                     ", ".join(split) or "nothing (replicated)")
        self._sharding = sharding
        self._programs: dict[tuple[int, int], object] = {}
        self.cache: OrderedDict[str, np.ndarray] = OrderedDict()   # hash -> [tokens, D], oldest use first
        self.cache_tokens = self.default_cache_tokens() if cache_tokens is None else cache_tokens
        self.cached_tokens = 0     # rows held now, at most cache_tokens
        self.hits = self.misses = 0
        self.seconds = 0.0         # spent running the encoder (a miss's program call, to its rows on the host)
        self.warm = False

    def default_cache_tokens(self) -> int:
        return self.DEFAULT_CACHE_IMAGES * self.cfg.mm_tokens_per_image

    def compile(self) -> None:
        """The encoder of the model's image size, compiled now (a server's start-up)."""
        S = self.cfg.image_size
        self._program((S, S))
        self.warm = True
        n = self.cfg.mm_tokens_per_image
        log.info("vision encoder: %dx%d px images -> %d tokens each; encoder cache budget %d tokens "
                 "(%d images, %.1f MiB)", S, S, n, self.cache_tokens, self.cache_tokens // n,
                 self.cache_tokens * self.cfg.text_hidden_size * 4 / 2**20)

    def _program(self, hw: tuple[int, int]):
        prog = self._programs.get(hw)
        if prog is None:
            cfg, module = self.cfg, self.module
            spec = jax.ShapeDtypeStruct((1, 3, *hw), jnp.float32, sharding=self._sharding)
            params = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), self.params)
            prog = self._programs[hw] = jax.jit(lambda p, px: module.encode(cfg, p, px)).lower(params, spec).compile()
        return prog

    def run(self, pixels: np.ndarray, grid) -> np.ndarray:
        """One image through its compiled program: pixels [3, H, W] -> rows [mm_tokens_per_image, D]."""
        prog = self._program(tuple(pixels.shape[-2:]))
        return np.asarray(prog(self.params, pixels[None].astype(np.float32)))[0]

    def encode(self, pixels: np.ndarray, key: str, grid=None) -> np.ndarray:
        """One image (``grid``: a Qwen image's (t, h, w), else None) -> its rows [tokens, D]
        float32 (from the cache if seen)."""
        rows = self.cache.get(key)
        if rows is not None:
            self.hits += 1
            self.cache.move_to_end(key)
            return rows
        self.misses += 1
        before = cc.counts()
        t0 = time.perf_counter()
        rows = self.run(pixels, grid)
        self.seconds += time.perf_counter() - t0
        after = cc.counts()
        if self.warm and (after["traces"] > before["traces"] or after["compiles"] > before["compiles"]):
            msg = f"the vision encoder compiled {after['compiles'] - before['compiles']} programs after warm-up"
            if self.strict:
                raise CompileGuardError(msg)
            log.warning(msg)
        if len(rows) <= self.cache_tokens:
            # least recently used out first, until the new image's rows fit the budget
            while self.cached_tokens + len(rows) > self.cache_tokens:
                self.cached_tokens -= len(self.cache.popitem(last=False)[1])
            self.cache[key] = rows
            self.cached_tokens += len(rows)
        return rows

    def request_images(self, images, num_prompt: int) -> RequestImages:
        """A request's ``ImageInput``s -> its rows by prompt position."""
        row = np.full(num_prompt, -1, np.int32)
        visible = np.arange(num_prompt, dtype=np.int32)
        embeds, n = [], 0
        for im in images:
            e = self.encode(im.pixels, im.hash, im.grid)                     # [length, D]
            span = slice(im.start, im.start + im.length)
            row[span] = np.arange(n, n + im.length, dtype=np.int32)
            if self.bidirectional:                                           # else causal, like text
                visible[span] = im.start + im.length - 1
            embeds.append(e)
            n += im.length
        return RequestImages(row, visible, np.concatenate(embeds).astype(np.float32))
