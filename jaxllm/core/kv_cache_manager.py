"""Paged KV-cache bookkeeping: a pool of fixed-size blocks and each request's block table.

Pure Python (no JAX): the device arrays live in the runner, which only ever sees block
ids.  A block holds ``block_size`` consecutive token positions of one sequence in every
layer; request ``r``'s token at position ``p`` lives in block ``block_ids(r)[p // block_size]``
at offset ``p % block_size``.
"""

from __future__ import annotations

from collections import deque


class BlockPool:
    """Block ids ``first .. num_blocks - 1`` with a free list and reference counts."""

    def __init__(self, num_blocks: int, first: int = 0):
        if num_blocks <= first:
            raise ValueError(f"the KV cache needs at least {first + 1} blocks, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(first, num_blocks))
        self._ref_cnt = [0] * num_blocks

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise RuntimeError(f"asked for {n} blocks with {len(self._free)} free")
        out = [self._free.popleft() for _ in range(n)]
        for b in out:
            self._ref_cnt[b] = 1
        return out

    def release(self, block_ids: list[int]) -> None:
        for b in block_ids:
            if self._ref_cnt[b] <= 0:
                raise RuntimeError(f"block {b} released twice")
            self._ref_cnt[b] -= 1
            if self._ref_cnt[b] == 0:
                self._free.append(b)


NULL_BLOCK = 0
"""Never handed out: padding tokens write their K/V here, so every cache write in the
compiled step is in bounds and stays an in-place update."""


class KVCacheManager:
    """Grows and frees each request's block table; keyed by request id."""

    def __init__(self, num_blocks: int, block_size: int):
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, first=NULL_BLOCK + 1)
        self._blocks: dict[str, list[int]] = {}

    @property
    def num_blocks(self) -> int:
        """Blocks requests can use (the null block excluded)."""
        return self.pool.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def get_block_ids(self, request_id: str) -> list[int]:
        return self._blocks.get(request_id, [])

    def allocate_slots(self, request_id: str, num_total_tokens: int) -> list[int] | None:
        """Makes room for ``num_total_tokens`` positions; returns the new blocks, or None
        (allocating nothing) when the pool cannot hold them."""
        have = self._blocks.setdefault(request_id, [])
        need = self.blocks_needed(num_total_tokens) - len(have)
        if need <= 0:
            return []
        if need > self.pool.num_free_blocks:
            if not have:
                del self._blocks[request_id]
            return None
        new = self.pool.allocate(need)
        have.extend(new)
        return new

    def free(self, request_id: str) -> None:
        blocks = self._blocks.pop(request_id, None)
        if blocks:
            # Freed in reverse so a request's tail blocks are reused first.
            self.pool.release(list(reversed(blocks)))

    @property
    def num_requests(self) -> int:
        return len(self._blocks)
