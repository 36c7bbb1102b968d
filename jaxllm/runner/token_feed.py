"""The device-side token feed of async scheduling: step N's sampled tokens stay on the
device and become step N+1's input ids there, so the host can prepare N+1 before N ends.

After each sampler run, ``scatter`` writes its tokens [S] into a buffer indexed by sampler
row slot (sample/states.py: a request keeps its slot while it runs); ``feed`` then puts into
the next step's packed inputs (runner/packing.py), at the input-id words the host left as
placeholders, the buffer's entry of the slot the host names for each (-1: keep the host's).
Both are compiled ahead of time beside the step programs (``compile``), so serving never
traces or compiles them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.runner import packing
from jaxllm.runner.inputs import input_spec
from jaxllm.runner.step_config import StepConfig


class TokenFeed:
    def __init__(self, cfg: StepConfig, num_slots: int, replicated):
        """``num_slots``: sampler row slots, the scratch row included; ``replicated``: the
        sharding every step input has."""
        self.cfg = cfg
        self._rep = replicated
        self.last = jax.device_put(np.zeros(num_slots, np.int32), replicated)   # [R] i32, by slot
        self._scatters: dict[int, object] = {}   # S -> compiled scatter
        self._feeds: dict[tuple[int, int], object] = {}   # (T, S) -> compiled feed

    def compile(self, buckets) -> None:
        """Compiles the scatter of every sequence bucket and the feed of every bucket."""
        R = self.last.shape[0]

        def i32(*shape):
            return jax.ShapeDtypeStruct(shape, jnp.int32, sharding=self._rep)

        def scatter(last, slots, tokens):       # last [R], slots [S], tokens [S] -> [R]
            return last.at[slots].set(tokens)

        for T, S in buckets:
            if S not in self._scatters:
                self._scatters[S] = jax.jit(scatter, out_shardings=self._rep).lower(
                    i32(R), i32(S), i32(S)).compile()
            if (T, S) in self._feeds:
                continue
            spec = input_spec(self.cfg, T, S, self._rep)
            lo, hi = packing.span(spec, spec.input_ids)

            def feed(words, last, src, lo=lo, hi=hi):   # words [W] u32, last [R], src [T] -> [W]
                ids = words[lo:hi]
                fed = last[jnp.clip(src, 0, R - 1)].astype(jnp.uint32)
                return words.at[lo:hi].set(jnp.where(src >= 0, fed, ids))

            words = jax.ShapeDtypeStruct((packing.num_words(spec),), jnp.uint32, sharding=self._rep)
            self._feeds[T, S] = jax.jit(feed, out_shardings=self._rep).lower(words, i32(R), i32(T)).compile()

    def record(self, S: int, slots: np.ndarray, tokens: jax.Array) -> None:
        """Keeps a sampler run's ``tokens`` [S] (on the device) under the rows' ``slots`` [S]."""
        self.last = self._scatters[S](self.last, slots, tokens)

    def apply(self, bucket: tuple[int, int], words: np.ndarray, src: np.ndarray) -> jax.Array:
        """``words``: a step's packed inputs; ``src`` [T]: per input token, the slot whose last
        token it takes (-1: the host's id).  The words on the device, the tokens fed."""
        return self._feeds[bucket](words, self.last, src)
