"""Paged KV-cache bookkeeping: a pool of fixed-size blocks, each request's block table, and
automatic prefix caching.

Pure Python (no JAX): the device arrays live in the runner, which only ever sees block
ids.  A block holds ``block_size`` consecutive token positions of one sequence in every
layer; request ``r``'s token at position ``p`` lives in block ``block_ids(r)[p // block_size]``
at offset ``p % block_size``.

Prefix caching (vLLM's automatic prefix caching).  Once a *full* block's K/V has been
computed it is registered under a hash that chains over (the parent block's hash, the
block's token ids, the request's cache salt): two blocks match only when the whole prefix
up to and including them is the same token sequence under the same salt.  Blocks carry
reference counts; a block whose count drops to zero goes to the end of the free list but
keeps its hash, so a later request can still reuse it; allocation takes blocks from the
front of the free list (least recently freed first) and only then forgets their hash
(eviction, least-recently-used).  A new request reuses the longest chain of cached full
blocks of its tokens, but never all of them: at least one token is computed so there are
logits to sample from (a fully cached block-aligned prompt recomputes its last block, as
vLLM does).
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict

NULL_BLOCK = 0
"""Never handed out: padding tokens write their K/V here, so every cache write in the
compiled step is in bounds and stays an in-place update."""

ROOT_HASH = b"\x00" * 32
"""The parent hash of a sequence's first block."""


def hash_block(parent: bytes, token_ids, cache_salt: str | None, adapter: int = 0) -> bytes:
    """The chained hash of one full block.

    SHA-256 over a fixed, unambiguous byte encoding (parent digest, salt with its length,
    token ids as little-endian int64), not Python's ``hash()``: that one is salted per
    process for strings (hashes would differ between processes and runs) and collisions of
    a 64-bit tuple hash can be constructed on purpose, which would let one tenant's prompt
    be answered from another's KV.  A SHA-256 collision is out of reach, and hashing a
    16-token block costs about a microsecond.  ``adapter``: the LoRA adapter's id the KV was
    computed with (0: the base model; the base's hashes are those without it).
    """
    salt = b"" if cache_salt is None else cache_salt.encode("utf-8")
    h = hashlib.sha256(parent)
    h.update(struct.pack("<?Q", cache_salt is not None, len(salt)))
    h.update(salt)
    if adapter:
        h.update(b"lora" + struct.pack("<q", adapter))
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    return h.digest()


class BlockPool:
    """Block ids ``first .. num_blocks - 1``: reference counts, an LRU-ordered free list and
    the hash -> block map of cached full blocks."""

    def __init__(self, num_blocks: int, first: int = 0):
        if num_blocks <= first:
            raise ValueError(f"the KV cache needs at least {first + 1} blocks, got {num_blocks}")
        self.num_blocks = num_blocks
        # Free blocks, least recently freed first; cached ones keep their hash until reused.
        self._free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(first, num_blocks))
        self._ref_cnt = [0] * num_blocks
        self._hash: list[bytes | None] = [None] * num_blocks
        self._cached: dict[bytes, int] = {}
        self.num_evictions = 0

    @property
    def num_free_blocks(self) -> int:
        """Blocks no request holds (cached ones included: they are evicted when needed)."""
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def ref_count(self, block: int) -> int:
        return self._ref_cnt[block]

    def block_hash(self, block: int) -> bytes | None:
        return self._hash[block]

    def lookup(self, block_hash: bytes) -> int | None:
        return self._cached.get(block_hash)

    def allocate(self, n: int) -> list[int]:
        """``n`` blocks from the front of the free list; a cached one loses its hash (evicted)."""
        if n > len(self._free):
            raise RuntimeError(f"asked for {n} blocks with {len(self._free)} free")
        out = []
        for _ in range(n):
            b, _ = self._free.popitem(last=False)
            h = self._hash[b]
            if h is not None:
                del self._cached[h]
                self._hash[b] = None
                self.num_evictions += 1
            self._ref_cnt[b] = 1
            out.append(b)
        return out

    def touch(self, blocks: list[int]) -> None:
        """Takes a reference to cached blocks (a prefix-cache hit); free ones leave the free list."""
        for b in blocks:
            if self._ref_cnt[b] == 0:
                del self._free[b]
            self._ref_cnt[b] += 1

    def num_unreferenced(self, blocks: list[int]) -> int:
        return sum(1 for b in blocks if self._ref_cnt[b] == 0)

    def cache(self, block: int, block_hash: bytes) -> None:
        """Registers a computed full block under its hash (a block already cached under that
        hash wins: this one stays unregistered and is freed like any other)."""
        if block_hash in self._cached or self._hash[block] is not None:
            return
        self._hash[block] = block_hash
        self._cached[block_hash] = block

    def release(self, block_ids: list[int]) -> None:
        for b in block_ids:
            if self._ref_cnt[b] <= 0:
                raise RuntimeError(f"block {b} released twice")
            self._ref_cnt[b] -= 1
            if self._ref_cnt[b] == 0:
                self._free[b] = None     # most recently used end


class KVCacheManager:
    """Grows and frees each request's block table; keyed by request id."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False):
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks, first=NULL_BLOCK + 1)
        self._blocks: dict[str, list[int]] = {}
        self._num_committed: dict[str, int] = {}
        """Per request: how many of its leading blocks are registered (or found) in the cache."""
        self.prefix_cache_queries = 0
        """Tokens looked up in the prefix cache (prompts of newly admitted requests)."""
        self.prefix_cache_hits = 0
        """Of those, tokens served from the cache."""

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

    # ------------------------------------------------------------------ prefix cache

    def block_hashes(self, request, num_blocks: int) -> list[bytes]:
        """The chained hashes of the request's first ``num_blocks`` full blocks (memoized on
        the request: its tokens only ever grow)."""
        hashes = request.block_hashes
        bs = self.block_size
        if len(hashes) < num_blocks:
            tokens = request.all_token_ids
            parent = hashes[-1] if hashes else ROOT_HASH
            for i in range(len(hashes), num_blocks):
                parent = hash_block(parent, tokens[i * bs:(i + 1) * bs], request.cache_salt,
                                    request.lora_int_id)
                hashes.append(parent)
        return hashes[:num_blocks]

    def find_cached_prefix(self, request) -> list[int]:
        """Blocks holding the longest cached prefix of the request's tokens (full blocks only,
        leaving at least one token to compute).  Looks only; takes no reference."""
        if not self.enable_prefix_caching or request.skip_prefix_cache:
            return []
        max_blocks = (request.num_tokens - 1) // self.block_size
        hit: list[int] = []
        for h in self.block_hashes(request, max_blocks):
            b = self.pool.lookup(h)
            if b is None:
                break
            hit.append(b)
        return hit

    def count_query(self, num_tokens: int, num_hit_tokens: int) -> None:
        self.prefix_cache_queries += num_tokens
        self.prefix_cache_hits += num_hit_tokens

    def cache_computed_blocks(self, request) -> None:
        """Registers the request's full blocks whose K/V are now computed."""
        if not self.enable_prefix_caching:
            return
        rid = request.request_id
        blocks = self._blocks.get(rid)
        if not blocks:
            return
        # Async scheduling counts the in-flight token as computed before the host has it: a
        # block it completes is hashed (and cached) once its last token is known.
        known = min(request.num_computed_tokens, request.num_tokens)
        n_full = min(known // self.block_size, len(blocks))
        done = self._num_committed.get(rid, 0)
        if n_full <= done:
            return
        hashes = self.block_hashes(request, n_full)
        for i in range(done, n_full):
            self.pool.cache(blocks[i], hashes[i])
        self._num_committed[rid] = n_full

    # ------------------------------------------------------------------ allocation

    def can_allocate(self, request_id: str, num_total_tokens: int, cached: list[int] = ()) -> bool:
        have = self._blocks.get(request_id, [])
        need = self.blocks_needed(num_total_tokens) - len(have) - len(cached)
        return need <= self.pool.num_free_blocks - self.pool.num_unreferenced(list(cached))

    def allocate_slots(self, request_id: str, num_total_tokens: int,
                       cached: list[int] = ()) -> list[int] | None:
        """Makes room for ``num_total_tokens`` positions; returns the new blocks, or None
        (allocating nothing) when the pool cannot hold them.  ``cached``: prefix-cache hits
        (from :meth:`find_cached_prefix`) that start a request's block table; they are
        referenced before anything is allocated, so no allocation can evict them."""
        if not self.can_allocate(request_id, num_total_tokens, cached):
            return None
        have = self._blocks.setdefault(request_id, [])
        if cached:
            assert not have, "cached blocks can only start a block table"
            self.pool.touch(list(cached))
            have.extend(cached)
            self._num_committed[request_id] = len(cached)
        need = self.blocks_needed(num_total_tokens) - len(have)
        if need <= 0:
            return []
        new = self.pool.allocate(need)
        have.extend(new)
        return new

    def free(self, request_id: str) -> None:
        blocks = self._blocks.pop(request_id, None)
        self._num_committed.pop(request_id, None)
        if blocks:
            # Freed in reverse so a request's tail blocks (the least likely to be shared) are
            # evicted first.
            self.pool.release(list(reversed(blocks)))

    @property
    def num_requests(self) -> int:
        return len(self._blocks)
