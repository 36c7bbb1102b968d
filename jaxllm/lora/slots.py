"""The device slot arrays of the adapters and their writer.

Per target projection ``A [max_loras, L, in, R]`` and ``B [max_loras, L, R, out]`` float32
(``R`` = max_lora_rank; an adapter of smaller rank is zero-padded, the padding adds zero).
One compiled program writes an adapter into a slot (the old arrays donated: updated in
place), compiled at warm-up with the slot a traced argument, so loading, swapping or
unloading an adapter never compiles afterwards.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.lora.peft import LoRAWeights
from jaxllm.lora.targets import Target


def _write(weights: dict, slot: jax.Array, new: dict) -> dict:
    # weights: param -> (A [S, L, in, R], B [S, L, R, out]); new: param -> (A [L, in, R], B [L, R, out])
    return {n: (A.at[slot].set(new[n][0]), B.at[slot].set(new[n][1])) for n, (A, B) in weights.items()}


class LoRASlotArrays:
    def __init__(self, targets: dict[str, Target], num_layers: int, max_loras: int, max_rank: int, sharding):
        self.targets, self.L, self.R = targets, num_layers, max_rank
        self.sharding = sharding
        self.weights = {n: (jax.device_put(jnp.zeros((max_loras, num_layers, t.in_size, max_rank), jnp.float32),
                                           sharding),
                            jax.device_put(jnp.zeros((max_loras, num_layers, max_rank, t.out_size), jnp.float32),
                                           sharding))
                        for n, t in targets.items()}
        self._writer = jax.jit(_write, donate_argnums=(0,), out_shardings=sharding)

    def _padded(self, w: LoRAWeights | None) -> dict:
        """param -> (A [L, in, R], B [L, R, out]) numpy: the adapter's, zero-padded; zeros where it has none."""
        out = {}
        for n, t in self.targets.items():
            A = np.zeros((self.L, t.in_size, self.R), np.float32)
            B = np.zeros((self.L, self.R, t.out_size), np.float32)
            if w is not None and n in w.weights:
                a, b = w.weights[n]
                A[:, :, :w.rank] = a
                B[:, :w.rank, :] = b
            out[n] = (A, B)
        return out

    def write(self, slot: int, w: LoRAWeights | None) -> None:
        """Puts adapter ``w`` (None: zeros) into ``slot``."""
        new = jax.device_put(self._padded(w), self.sharding)
        self.weights = self._writer(self.weights, jax.device_put(np.int32(slot), self.sharding), new)

    def compile(self) -> None:
        """Compiles the writer (warm-up): writes zeros into slot 0."""
        self.write(0, None)
