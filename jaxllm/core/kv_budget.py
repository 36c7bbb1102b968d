"""KV-cache sizing: from a byte budget for the whole cache to a number of blocks.

Pure arithmetic, no JAX.  The cache is described by kinds (:class:`CacheKind`): per group of
layers, what each layer stores per token (K and V pages; MLA's latent and rope key) or per
sequence (a recurrent state: a linear-attention layer's conv and delta-rule state).  A block's
bytes sum every paged kind over every layer of its group (``block_bytes``), a sequence slot's
bytes every per-sequence kind over every layer (``slot_bytes``), so a budget divided by them
can never allocate more than the budget (the reference engines' worst bug here divided by one
layer's page while every layer allocated a buffer; vllm.cpp counted one placeholder layer per
group, and a 1 GiB budget allocated 8.5 GiB).  The size of a
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
class CacheKind:
    """What every layer of one group keeps: ``token_bytes`` per token (a paged kind, in
    blocks) or ``seq_bytes`` per sequence (a state kind, one slot per running sequence)."""

    name: str
    """For the start-up log ("K/V", "MLA latent + rope key", "recurrent state")."""
    num_layers: int
    """Layers of the group: each allocates its own arrays, so each is counted."""
    token_bytes: int = 0
    """One token in one layer, as stored (a quantized cache's scales included)."""
    seq_bytes: int = 0
    """One sequence's state in one layer."""

    def __post_init__(self):
        if self.num_layers < 1:
            raise ValueError(f"cache kind {self.name!r}: num_layers must be positive, got {self.num_layers}")
        if (self.token_bytes > 0) == (self.seq_bytes > 0) or min(self.token_bytes, self.seq_bytes) < 0:
            raise ValueError(f"cache kind {self.name!r} stores either per token or per sequence: "
                             f"token_bytes={self.token_bytes}, seq_bytes={self.seq_bytes}")

    @property
    def paged(self) -> bool:
        return self.token_bytes > 0



def human_bytes(n: int) -> str:
    """``n`` bytes in the unit a person reads: KiB, MiB or GiB."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} bytes"

def kv_kind(num_layers: int, token_bytes: int) -> CacheKind:
    """The K/V pages of ``num_layers`` attention layers (``token_bytes``: K and V of one layer)."""
    return CacheKind("K/V", num_layers, token_bytes=token_bytes)


def block_bytes(kinds: tuple[CacheKind, ...], block_size: int) -> int:
    """One block of every layer of every paged kind."""
    return sum(k.num_layers * block_size * k.token_bytes for k in kinds if k.paged)


def slot_bytes(kinds: tuple[CacheKind, ...]) -> int:
    """One sequence's state in every layer of every per-sequence kind."""
    return sum(k.num_layers * k.seq_bytes for k in kinds if not k.paged)


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
    kinds: tuple[CacheKind, ...] = ()
    """What the cache holds, per group of layers (empty: K/V only, as ``bytes_per_block`` says)."""
    seq_slots: int = 0
    """Sequences the per-sequence kinds have state for (0: the cache has none): the most
    sequences that can run at once."""
    bytes_per_slot: int = 0
    seqs_asked: int = 0
    """``max_num_seqs`` as asked, when the budget seats fewer (``seq_slots``); else 0."""

    @property
    def total_bytes(self) -> int:
        return self.num_blocks * self.bytes_per_block + self.seq_slots * self.bytes_per_slot

    def kind_bytes(self, kind: CacheKind) -> int:
        """The bytes every layer of ``kind`` allocates under this plan."""
        if kind.paged:
            return kind.num_layers * self.num_blocks * self.block_size * kind.token_bytes
        return kind.num_layers * self.seq_slots * kind.seq_bytes

    def shares(self) -> str:
        """Each kind's layers and share of the bytes, for the start-up line."""
        total = self.total_bytes or 1
        return ", ".join(f"{k.name} {k.num_layers} layers {self.kind_bytes(k) / 2**20:.1f} MiB "
                         f"({100 * self.kind_bytes(k) / total:.1f}%)" for k in self.kinds)

    @property
    def num_usable_tokens(self) -> int:
        return (self.num_blocks - 1) * self.block_size

    def describe(self, max_model_len: int) -> str:
        dtype = ""
        if self.kv_dtype:
            dtype = f" as {self.kv_dtype}"
            if self.token_gain is not None:
                dtype += f" ({self.token_gain:.2f}x the tokens of {self.model_dtype} in the same bytes)"
        slots = ""
        if self.seq_slots:
            slots = f", state for {self.seq_slots} sequences ({self.bytes_per_slot} bytes each across all layers"
            slots += (f"; max_num_seqs={self.seqs_asked} clamped to what the budget seats)" if self.seqs_asked
                      else ")")
        kinds = f"; {self.shares()}" if self.kinds else ""
        return (f"KV cache: {self.num_blocks} blocks x {self.block_size} tokens (1 reserved), "
                f"{self.bytes_per_block} bytes per block across all layers, "
                f"{self.total_bytes / 2**20:.1f} MiB, {self.num_usable_tokens} tokens{dtype}, "
                f"{self.num_usable_tokens / max_model_len:.2f} sequences of max_model_len={max_model_len}"
                + slots + kinds + (f" ({self.source})" if self.source else ""))


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


def plan_kv_cache(*, block_size: int, max_model_len: int, max_num_seqs: int, budget_bytes: int | None,
                  num_blocks_override: int | None, num_layers: int | None = None, token_bytes: int | None = None,
                  kinds: tuple[CacheKind, ...] | None = None, budget_flag: str | None = None,
                  platform: str = "cpu", measured: bool = False) -> KVPlan:
    """Blocks (and state slots) to allocate: one null block plus the usable ones, never more
    bytes than the budget.  ``kinds``: what the cache holds (:class:`CacheKind`); without them
    one K/V kind of ``num_layers`` layers of ``token_bytes`` (one token's K and V in one layer
    as stored, scales included).  ``budget_flag``: how the budget was given, for the refusal
    message (default: ``--kv-cache-memory-bytes=<budget>``).  ``measured``: the budget was
    derived from free memory (``--gpu-memory-utilization``), so the count is rounded to a
    coarse grain.  Without a budget: on CPU the fixed :data:`CPU_DEFAULT_KV_BYTES`; on an
    accelerator room for ``max_num_seqs`` full sequences within a quarter of free memory,
    rounded coarsely.

    Per-sequence kinds take their slots first: ``max_num_seqs`` of them, or as many as the
    budget seats beside one full sequence's blocks (``KVPlan.seqs_asked`` then says so); the
    blocks get the rest."""
    if kinds is None:
        if num_layers is None or token_bytes is None:
            raise ValueError("plan_kv_cache needs kinds, or num_layers and token_bytes")
        kinds = (kv_kind(num_layers, token_bytes),)
    kinds = tuple(kinds)
    per_block = block_bytes(kinds, block_size)
    per_slot = slot_bytes(kinds)
    if per_block <= 0:
        raise ValueError("the cache has no paged kind: every model has at least one attention layer")
    need = -(-max_model_len // block_size) + 1        # one full sequence plus the null block
    flag = budget_flag or f"--kv-cache-memory-bytes={budget_bytes}"

    def plan(num_blocks: int, source: str, budget=budget_bytes, slots: int = max_num_seqs) -> KVPlan:
        return KVPlan(num_blocks, block_size, per_block, budget, source, kinds=kinds,
                      seq_slots=slots if per_slot else 0, bytes_per_slot=per_slot,
                      seqs_asked=max_num_seqs if per_slot and slots < max_num_seqs else 0)

    def seats(room: int) -> int:
        """State slots that fit in ``room`` beside one full sequence's blocks, at most max_num_seqs."""
        if not per_slot:
            return max_num_seqs
        return min(max_num_seqs, max(room - need * per_block, 0) // per_slot)

    if num_blocks_override is not None:
        if num_blocks_override < need:
            raise ValueError(
                f"--num-gpu-blocks-override={num_blocks_override} holds {(num_blocks_override - 1) * block_size} "
                f"tokens (one block is reserved), fewer than one sequence of max_model_len={max_model_len}; "
                f"it needs at least {need}, or lower --max-model-len")
        return plan(num_blocks_override, f"--num-gpu-blocks-override={num_blocks_override}")
    if budget_bytes is None:
        want = (need - 1) * max_num_seqs + 1      # max_num_seqs full-length sequences
        if platform == "cpu":
            slots = max(1, seats(CPU_DEFAULT_KV_BYTES))
            num_blocks = max(need, min(want, (CPU_DEFAULT_KV_BYTES - slots * per_slot) // per_block))
            return plan(num_blocks, f"the CPU default of {CPU_DEFAULT_KV_BYTES // 2**20} MiB, or one sequence at "
                        f"least; --kv-cache-memory-bytes sets it", None, slots)
        room = available_memory_bytes() // 4
        slots = max(1, seats(room))
        num_blocks = max(need, min(want, coarse_blocks(max(room - slots * per_slot, 0) // per_block)))
        return plan(num_blocks, "a quarter of free memory at most, rounded; --kv-cache-memory-bytes sets it",
                    None, slots)
    slots = seats(budget_bytes)
    num_blocks = (budget_bytes - slots * per_slot) // per_block
    if measured and num_blocks >= need:
        num_blocks = coarse_blocks(num_blocks, need)
    if num_blocks < need or (per_slot and slots < 1):
        fits = max(num_blocks - 1, 0) * block_size
        state = f" and one sequence's state ({human_bytes(per_slot)})" if per_slot else ""
        needed = need * per_block + per_slot
        # The suggestions are values the flags accept: whole MiB, rounded up; a positive length.
        shorter = f", or use --max-model-len {fits} or less" if fits > 0 else ""
        raise ValueError(
            f"{flag} holds {num_blocks} blocks ({human_bytes(per_block)} per block "
            f"across all layers, one reserved) = {fits} tokens, fewer than one sequence of "
            f"max_model_len={max_model_len}{state}; it needs at least {human_bytes(needed)}: "
            f"use --kv-cache-memory-bytes {-(-needed // 2**20)}MiB or more{shorter}")
    return plan(num_blocks, flag, budget_bytes, slots)
