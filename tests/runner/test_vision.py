"""The vision encoder's cache (jaxllm/runner/vision.py): a budget in encoder tokens, least
recently used image evicted first, hits and misses counted, 0 tokens: no cache.  A stand-in
vision module (rows = the pixels' per-channel means, one program) keeps this to one tiny compile;
the real encoder's cache through the engine is tests/engine/test_images_end_to_end.py."""

from __future__ import annotations

from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm.config import CacheConfig
from jaxllm.runner.vision import VisionEncoder

TOKENS, D = 4, 3   # rows per image, text hidden size


def _module():
    def encode(cfg, params, px):                      # px [1, 3, S, S] -> [1, TOKENS, D]
        return jnp.broadcast_to(px.mean(axis=(2, 3))[:, None, :] * params["w"], (1, TOKENS, D))
    return SimpleNamespace(load_params=lambda cfg, tensors: {"w": jnp.ones((D,), jnp.float32)}, encode=encode)


def _encoder(budget):
    cfg = SimpleNamespace(image_size=4, mm_tokens_per_image=TOKENS, text_hidden_size=D)
    rep = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    enc = VisionEncoder(_module(), SimpleNamespace(cfg=cfg, tensors={}), rep, strict=True, cache_tokens=budget)
    enc.compile()
    return enc


def _px(v: float) -> np.ndarray:
    return np.full((3, 4, 4), v, np.float32)


def test_encoder_cache_evicts_least_recently_used_within_its_token_budget():
    enc = _encoder(2 * TOKENS)                        # room for two images
    a = enc.encode(_px(1), "a")
    enc.encode(_px(2), "b")
    again = enc.encode(_px(1), "a")                   # a hit: a is now the most recent
    assert (enc.hits, enc.misses) == (1, 2) and again is a
    enc.encode(_px(3), "c")                           # evicts b (least recently used), not a
    assert list(enc.cache) == ["a", "c"] and enc.cached_tokens == 2 * TOKENS
    enc.encode(_px(1), "a")
    enc.encode(_px(2), "b")                           # b was evicted: encoded again
    assert (enc.hits, enc.misses) == (2, 4)
    np.testing.assert_array_equal(enc.cache["b"], np.full((TOKENS, D), 2, np.float32))
    assert _encoder(None).cache_tokens == VisionEncoder.DEFAULT_CACHE_IMAGES * TOKENS   # no budget given


def test_a_zero_budget_keeps_nothing_and_a_bad_budget_is_refused():
    enc = _encoder(0)
    enc.encode(_px(1), "a")
    enc.encode(_px(1), "a")
    assert (enc.hits, enc.misses, len(enc.cache)) == (0, 2, 0)
    with pytest.raises(ValueError, match="--mm-encoder-cache-tokens must be a non-negative integer"):
        CacheConfig(mm_encoder_cache_tokens=-1)
