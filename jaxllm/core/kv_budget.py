"""KV-cache sizing: from a byte budget for the whole cache to a number of blocks.

Pure arithmetic, no JAX.  ``bytes_per_block`` counts K and V of every layer, so a budget
divided by it can never allocate more than the budget (the reference engines' worst bug
here divided by one layer's page while every layer allocated a buffer).  The size of a
token is the cache storage's (``token_bytes``: K and V of one layer, quantized values and
their scales included, ``layers/kv_quant.token_bytes``), so a quantized cache holds more
tokens in the same bytes.

The block count is part of every compiled step's shape, so it must not follow the noise
in free memory, or a second start with the same flags misses the persistent compile cache
(7,193 blocks one start, 7,921 the next, measured here).  Without a size given, the CPU
takes a fixed budget (as vLLM's CPU backend does with ``VLLM_CPU_KVCACHE_SPACE``), and a
count derived from measured memory is rounded down to a coarse grain (:func:`coarse_blocks`).
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
    source: str = ""
    """How the size was chosen and which flag changes it, for the start-up log."""
    kv_dtype: str = ""
    """What the cache is stored as (the model dtype, or ``--kv-cache-dtype``), for the log."""
    model_dtype: str = ""
    token_gain: float | None = None
    """A quantized cache: tokens it holds per byte against one in ``model_dtype``."""

    @property
    def total_bytes(self) -> int:
        return self.num_blocks * self.bytes_per_block

    @property
    def num_usable_tokens(self) -> int:
        return (self.num_blocks - 1) * self.block_size

    def describe(self, max_model_len: int) -> str:
        dtype = ""
        if self.kv_dtype:
            dtype = f" as {self.kv_dtype}"
            if self.token_gain is not None:
                dtype += f" ({self.token_gain:.2f}x the tokens of {self.model_dtype} in the same bytes)"
        return (f"KV cache: {self.num_blocks} blocks x {self.block_size} tokens (1 reserved), "
                f"{self.bytes_per_block} bytes per block across all layers, "
                f"{self.total_bytes / 2**20:.1f} MiB, {self.num_usable_tokens} tokens{dtype}, "
                f"{self.num_usable_tokens / max_model_len:.2f} sequences of max_model_len={max_model_len}"
                + (f" ({self.source})" if self.source else ""))


CPU_DEFAULT_KV_BYTES = 512 * 2**20
"""The KV budget on CPU when no size is given: a fixed number, so the compiled shapes are the
same on every start (vLLM's CPU backend defaults to 4 GiB; 512 MiB keeps a small model's
idle server well under 2 GB resident and holds ~11k tokens of SmolLM2-135M in float32)."""


def coarse_blocks(num_blocks: int, minimum: int = 1) -> int:
    """``num_blocks`` rounded down to its 4 leading binary digits (at most 1/9 fewer), never
    below ``minimum``: counts derived from measured free memory land on the same value
    across starts unless the memory moved by more than the grain."""
    grain = 1 << max(num_blocks.bit_length() - 4, 0)
    return max(minimum, num_blocks // grain * grain)


def bytes_per_block(num_layers: int, block_size: int, token_bytes: int) -> int:
    """One block of every layer; ``token_bytes``: one token's K and V in one layer."""
    return num_layers * block_size * token_bytes


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _meminfo_available(path: str = "/proc/meminfo") -> int | None:
    try:
        with open(path) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def cgroup_room_bytes(root: str = "/sys/fs/cgroup") -> int | None:
    """What the process's memory cgroup still allows (limit minus usage), None without a limit.
    cgroup v2 (``memory.max``, ``memory.current``), else v1 (``memory/memory.limit_in_bytes``)."""
    for limit_name, usage_name in (("memory.max", "memory.current"),
                                   ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes")):
        limit = _read_int(os.path.join(root, limit_name))
        if limit is None or limit >= 2**60:       # "max" (v2) or the v1 "no limit" value
            continue
        usage = _read_int(os.path.join(root, usage_name)) or 0
        return max(limit - usage, 0)
    return None


def available_memory_bytes() -> int:
    """Memory this process may still take: MemAvailable, within the cgroup's remaining room."""
    avail = _meminfo_available()
    if avail is None:
        try:
            avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            avail = 8 * 2**30
    room = cgroup_room_bytes()
    return avail if room is None else min(avail, room)


def utilization_budget(utilization: float, free_bytes: int, activation_bytes: int = 0) -> int:
    """``--gpu-memory-utilization``: that fraction of the memory left once the weights are
    loaded (``free_bytes``) and the largest step's activations are set aside."""
    left = free_bytes - activation_bytes
    if left <= 0:
        raise ValueError(f"--gpu-memory-utilization={utilization}: no memory left for the KV cache "
                         f"({free_bytes} bytes free after the weights, {activation_bytes} bytes of activations); "
                         f"use --kv-cache-memory-bytes or --num-gpu-blocks-override")
    return int(utilization * left)


def plan_kv_cache(*, num_layers: int, token_bytes: int, block_size: int,
                  max_model_len: int, max_num_seqs: int, budget_bytes: int | None,
                  num_blocks_override: int | None, budget_flag: str | None = None,
                  platform: str = "cpu", measured: bool = False) -> KVPlan:
    """Blocks to allocate: one null block plus the usable ones, never more bytes than the budget.
    ``budget_flag``: how the budget was given, for the refusal message (default:
    ``--kv-cache-memory-bytes=<budget>``).  ``measured``: the budget was derived from free
    memory (``--gpu-memory-utilization``), so the count is rounded to a coarse grain.
    Without a budget: on CPU the fixed :data:`CPU_DEFAULT_KV_BYTES`; on an accelerator room
    for ``max_num_seqs`` full sequences within a quarter of free memory, rounded coarsely.
    ``token_bytes``: one token's K and V in one layer as stored (scales included)."""
    per_block = bytes_per_block(num_layers, block_size, token_bytes)
    need = -(-max_model_len // block_size) + 1        # one full sequence plus the null block
    if num_blocks_override is not None:
        if num_blocks_override < need:
            raise ValueError(
                f"--num-gpu-blocks-override={num_blocks_override} holds {(num_blocks_override - 1) * block_size} "
                f"tokens (one block is reserved), fewer than one sequence of max_model_len={max_model_len}; "
                f"it needs at least {need}, or lower --max-model-len")
        return KVPlan(num_blocks_override, block_size, per_block, budget_bytes,
                      f"--num-gpu-blocks-override={num_blocks_override}")
    if budget_bytes is None:
        want = (need - 1) * max_num_seqs + 1      # max_num_seqs full-length sequences
        if platform == "cpu":
            num_blocks = max(need, min(want, CPU_DEFAULT_KV_BYTES // per_block))
            return KVPlan(num_blocks, block_size, per_block, None,
                          f"the CPU default of {CPU_DEFAULT_KV_BYTES // 2**20} MiB, or one sequence at least; "
                          f"--kv-cache-memory-bytes sets it")
        num_blocks = max(need, min(want, coarse_blocks(available_memory_bytes() // 4 // per_block)))
        return KVPlan(num_blocks, block_size, per_block, None,
                      "a quarter of free memory at most, rounded; --kv-cache-memory-bytes sets it")
    num_blocks = budget_bytes // per_block
    if measured and num_blocks >= need:
        num_blocks = coarse_blocks(num_blocks, need)
    if num_blocks < need:
        fits = max(num_blocks - 1, 0) * block_size
        raise ValueError(
            f"{budget_flag or f'--kv-cache-memory-bytes={budget_bytes}'} holds {num_blocks} blocks ({per_block} bytes per block "
            f"across all layers, one reserved) = {fits} tokens, fewer than one sequence of "
            f"max_model_len={max_model_len}; it needs at least {need * per_block} bytes, "
            f"or use --max-model-len {fits} or less")
    return KVPlan(num_blocks, block_size, per_block, budget_bytes,
                  budget_flag or f"--kv-cache-memory-bytes={budget_bytes}")
