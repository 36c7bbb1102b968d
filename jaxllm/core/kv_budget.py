"""KV-cache sizing: from a byte budget for the whole cache to a number of blocks.

Pure arithmetic, no JAX.  ``bytes_per_block`` counts K and V of every layer, so a budget
divided by it can never allocate more than the budget (the reference engines' worst bug
here divided by one layer's page while every layer allocated a buffer).
"""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class KVPlan:
    num_blocks: int
    """Blocks allocated per layer, including the null block that padding writes into."""
    block_size: int
    bytes_per_block: int
    budget_bytes: int | None

    @property
    def total_bytes(self) -> int:
        return self.num_blocks * self.bytes_per_block

    @property
    def num_usable_tokens(self) -> int:
        return (self.num_blocks - 1) * self.block_size

    def describe(self, max_model_len: int) -> str:
        return (f"KV cache: {self.num_blocks} blocks x {self.block_size} tokens (1 reserved), "
                f"{self.bytes_per_block} bytes per block across all layers, "
                f"{self.total_bytes / 2**20:.1f} MiB, {self.num_usable_tokens} tokens, "
                f"{self.num_usable_tokens / max_model_len:.2f} sequences of max_model_len={max_model_len}")


def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, itemsize: int) -> int:
    return 2 * num_layers * block_size * num_kv_heads * head_dim * itemsize


def available_memory_bytes() -> int:
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 8 * 2**30


def plan_kv_cache(*, num_layers: int, num_kv_heads: int, head_dim: int, itemsize: int, block_size: int,
                  max_model_len: int, max_num_seqs: int, budget_bytes: int | None,
                  num_blocks_override: int | None) -> KVPlan:
    """Blocks to allocate: one null block plus the usable ones, never more bytes than the budget."""
    per_block = bytes_per_block(num_layers, block_size, num_kv_heads, head_dim, itemsize)
    need = -(-max_model_len // block_size) + 1        # one full sequence plus the null block
    if num_blocks_override is not None:
        if num_blocks_override < need:
            raise ValueError(
                f"--num-gpu-blocks-override={num_blocks_override} holds {(num_blocks_override - 1) * block_size} "
                f"tokens (one block is reserved), fewer than one sequence of max_model_len={max_model_len}; "
                f"it needs at least {need}, or lower --max-model-len")
        return KVPlan(num_blocks_override, block_size, per_block, budget_bytes)
    if budget_bytes is None:
        # Room for max_num_seqs full-length sequences, within a quarter of free memory.
        want = (need - 1) * max_num_seqs + 1
        num_blocks = max(need, min(want, available_memory_bytes() // 4 // per_block))
        return KVPlan(num_blocks, block_size, per_block, None)
    num_blocks = budget_bytes // per_block
    if num_blocks < need:
        fits = max(num_blocks - 1, 0) * block_size
        raise ValueError(
            f"--kv-cache-memory-bytes={budget_bytes} holds {num_blocks} blocks ({per_block} bytes per block "
            f"across all layers, one reserved) = {fits} tokens, fewer than one sequence of "
            f"max_model_len={max_model_len}; it needs at least {need * per_block} bytes, "
            f"or use --max-model-len {fits} or less")
    return KVPlan(num_blocks, block_size, per_block, budget_bytes)
