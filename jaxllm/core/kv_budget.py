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
    block_size: int
    bytes_per_block: int
    budget_bytes: int | None

    @property
    def total_bytes(self) -> int:
        return self.num_blocks * self.bytes_per_block

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def describe(self, max_model_len: int) -> str:
        return (f"KV cache: {self.num_blocks} blocks x {self.block_size} tokens, "
                f"{self.bytes_per_block} bytes per block across all layers, "
                f"{self.total_bytes / 2**20:.1f} MiB, {self.num_tokens} tokens, "
                f"{self.num_tokens / max_model_len:.2f} sequences of max_model_len={max_model_len}")


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
    per_block = bytes_per_block(num_layers, block_size, num_kv_heads, head_dim, itemsize)
    blocks_per_seq = -(-max_model_len // block_size)
    if num_blocks_override is not None:
        num_blocks = num_blocks_override
        if num_blocks < blocks_per_seq:
            raise ValueError(
                f"--num-gpu-blocks-override={num_blocks} blocks hold {num_blocks * block_size} tokens, fewer than "
                f"one sequence of max_model_len={max_model_len} ({blocks_per_seq} blocks); raise it or lower "
                f"--max-model-len")
        return KVPlan(num_blocks, block_size, per_block, budget_bytes)
    if budget_bytes is None:
        want = blocks_per_seq * max_num_seqs * per_block
        budget_bytes = min(want, available_memory_bytes() // 4)
        budget_bytes = max(budget_bytes, blocks_per_seq * per_block)
        num_blocks = budget_bytes // per_block
        return KVPlan(num_blocks, block_size, per_block, None)
    num_blocks = budget_bytes // per_block
    if num_blocks < blocks_per_seq:
        fits = num_blocks * block_size
        raise ValueError(
            f"--kv-cache-memory-bytes={budget_bytes} holds {num_blocks} blocks = {fits} tokens "
            f"({per_block} bytes per block across all layers), fewer than one sequence of "
            f"max_model_len={max_model_len}; it needs at least {blocks_per_seq * per_block} bytes, "
            f"or use --max-model-len {max(fits, 0)} or less")
    return KVPlan(num_blocks, block_size, per_block, budget_bytes)
