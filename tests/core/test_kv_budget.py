"""KV-cache sizing arithmetic and the memory the process may use (no device)."""

from __future__ import annotations

import pytest

from jaxllm.core import kv_budget
from jaxllm.core.kv_budget import (
    bytes_per_block,
    cgroup_room_bytes,
    plan_kv_cache,
    utilization_budget,
)

ARCH = dict(num_layers=3, token_bytes=2 * 2 * 32 * 4, block_size=16)   # K and V, 2 heads of 32, float32


def test_bytes_per_block_counts_k_and_v_of_every_layer():
    assert bytes_per_block(num_layers=3, block_size=16, token_bytes=2 * 2 * 32 * 4) == 2 * 3 * 16 * 2 * 32 * 4


def test_budget_is_never_exceeded_and_a_too_small_one_says_what_fits():
    per = bytes_per_block(**ARCH)
    plan = plan_kv_cache(**ARCH, max_model_len=256, max_num_seqs=4, budget_bytes=100 * per + 7, num_blocks_override=None)
    assert plan.num_blocks == 100 and plan.total_bytes <= 100 * per + 7
    with pytest.raises(ValueError, match=r"--gpu-memory-utilization=0.1 \(x\) holds 3 blocks.*--max-model-len 32"):
        plan_kv_cache(**ARCH, max_model_len=256, max_num_seqs=4, budget_bytes=3 * per, num_blocks_override=None,
                      budget_flag="--gpu-memory-utilization=0.1 (x)")


def test_utilization_budget():
    assert utilization_budget(0.5, free_bytes=1000, activation_bytes=200) == 400
    with pytest.raises(ValueError, match="--gpu-memory-utilization=0.9: no memory left"):
        utilization_budget(0.9, free_bytes=100, activation_bytes=200)


def test_cgroup_room(tmp_path):
    assert cgroup_room_bytes(str(tmp_path)) is None                       # no cgroup files
    (tmp_path / "memory.max").write_text("max\n")
    assert cgroup_room_bytes(str(tmp_path)) is None                       # v2 without a limit
    (tmp_path / "memory.max").write_text("1000000\n")
    (tmp_path / "memory.current").write_text("250000\n")
    assert cgroup_room_bytes(str(tmp_path)) == 750000
    v1 = tmp_path / "v1"
    (v1 / "memory").mkdir(parents=True)
    (v1 / "memory" / "memory.limit_in_bytes").write_text("9223372036854771712\n")   # v1's "unlimited"
    assert cgroup_room_bytes(str(v1)) is None
    (v1 / "memory" / "memory.limit_in_bytes").write_text("5000\n")
    (v1 / "memory" / "memory.usage_in_bytes").write_text("6000\n")
    assert cgroup_room_bytes(str(v1)) == 0


def test_available_memory_is_capped_by_the_cgroup(monkeypatch):
    monkeypatch.setattr(kv_budget, "_meminfo_available", lambda: 8 * 2**30)
    monkeypatch.setattr(kv_budget, "cgroup_room_bytes", lambda: None)
    assert kv_budget.available_memory_bytes() == 8 * 2**30
    monkeypatch.setattr(kv_budget, "cgroup_room_bytes", lambda: 2**30)
    assert kv_budget.available_memory_bytes() == 2**30


def test_meminfo_is_read(tmp_path):
    (tmp_path / "meminfo").write_text("MemTotal: 100 kB\nMemFree: 10 kB\nMemAvailable:   4096 kB\n")
    assert kv_budget._meminfo_available(str(tmp_path / "meminfo")) == 4096 * 1024
    assert kv_budget._meminfo_available(str(tmp_path / "missing")) is None


def test_default_size_on_cpu_does_not_follow_free_memory(monkeypatch):
    """The block count is part of every compiled shape: the same flags must give the same pool
    whatever memory is free, or the second start misses the persistent compile cache."""
    plans = []
    for free in (7 * 2**30, 23 * 2**30, 300 * 2**20):
        monkeypatch.setattr(kv_budget, "available_memory_bytes", lambda free=free: free)
        plans.append(plan_kv_cache(**ARCH, max_model_len=256, max_num_seqs=10_000, budget_bytes=None,
                                   num_blocks_override=None, platform="cpu"))
    assert len({p.num_blocks for p in plans}) == 1, [p.num_blocks for p in plans]
    assert plans[0].total_bytes <= kv_budget.CPU_DEFAULT_KV_BYTES
    assert "--kv-cache-memory-bytes" in plans[0].describe(256)
    # A model whose one sequence needs more than the default still gets one sequence.
    big = plan_kv_cache(**ARCH, max_model_len=2**22, max_num_seqs=4, budget_bytes=None,
                        num_blocks_override=None, platform="cpu")
    assert big.num_usable_tokens >= 2**22


def test_measured_sizes_are_rounded_to_a_coarse_grain(monkeypatch):
    per = bytes_per_block(**ARCH)
    assert kv_budget.coarse_blocks(7193) == kv_budget.coarse_blocks(7500) == 7168
    for n in (17, 100, 1000, 7193, 7921, 123_456):
        c = kv_budget.coarse_blocks(n)
        assert n * 8 / 9 <= c <= n
    # --gpu-memory-utilization: free memory that moved by a few percent gives the same pool.
    counts = {plan_kv_cache(**ARCH, max_model_len=256, max_num_seqs=4, budget_bytes=b * per,
                            num_blocks_override=None, measured=True).num_blocks for b in (7193, 7300, 7600)}
    assert counts == {7168}
    # An explicit byte budget is used as given.
    assert plan_kv_cache(**ARCH, max_model_len=256, max_num_seqs=4, budget_bytes=7193 * per,
                         num_blocks_override=None).num_blocks == 7193
    # On an accelerator without a size, the quarter of free memory is rounded too.
    monkeypatch.setattr(kv_budget, "available_memory_bytes", lambda: 4 * 7193 * per)
    a = plan_kv_cache(**ARCH, max_model_len=256, max_num_seqs=10_000, budget_bytes=None,
                      num_blocks_override=None, platform="gpu")
    monkeypatch.setattr(kv_budget, "available_memory_bytes", lambda: 4 * 7600 * per)
    b = plan_kv_cache(**ARCH, max_model_len=256, max_num_seqs=10_000, budget_bytes=None,
                      num_blocks_override=None, platform="gpu")
    assert a.num_blocks == b.num_blocks == 7168


# ----------------------------------------------------------------------------- cache kinds

# A hybrid layout where counting one layer per group shows: two full-attention layers' K/V
# pages and four linear-attention layers' recurrent state (per sequence); and an MLA layout.
HYBRID = (kv_budget.CacheKind("K/V", 2, token_bytes=2 * 2 * 32 * 4),
          kv_budget.CacheKind("recurrent state", 4, seq_bytes=3 * 4096 * 4))
MLA = (kv_budget.CacheKind("MLA latent + rope key", 3, token_bytes=(64 + 16) * 4),)


def _allocate(plan):
    """Arrays of the plan's shapes, per layer of every kind (as a runner would), read back."""
    import numpy as np
    arrays = []
    for k in plan.kinds:
        for _ in range(k.num_layers):
            shape = (plan.num_blocks, plan.block_size, k.token_bytes) if k.paged else (plan.seq_slots, k.seq_bytes)
            arrays.append(np.zeros(shape, np.uint8))
    return sum(a.nbytes for a in arrays)


@pytest.mark.parametrize("kinds", [HYBRID, MLA], ids=["hybrid", "mla"])
@pytest.mark.parametrize("budget", [1 << 20, 5 * (1 << 20) + 4321])
def test_every_kind_of_every_layer_stays_within_the_budget(kinds, budget):
    plan = plan_kv_cache(kinds=kinds, block_size=16, max_model_len=256, max_num_seqs=8, budget_bytes=budget,
                         num_blocks_override=None)
    nbytes = _allocate(plan)
    assert nbytes == plan.total_bytes == sum(plan.kind_bytes(k) for k in kinds)
    assert nbytes <= budget
    assert budget - nbytes < plan.bytes_per_block            # the rest of the budget went to blocks
    # Every layer of every group counted: a block of the hybrid layout is 2 layers of K/V,
    # a slot 4 layers of state.
    assert plan.bytes_per_block == sum(k.num_layers * 16 * k.token_bytes for k in kinds if k.paged)
    assert plan.bytes_per_slot == sum(k.num_layers * k.seq_bytes for k in kinds if not k.paged)
    line = plan.describe(256)
    for k in kinds:
        assert f"{k.name} {k.num_layers} layers" in line


def test_hybrid_state_slots_clamp_max_num_seqs_to_what_the_budget_seats():
    kv, state = HYBRID
    per_block, per_slot = 2 * 16 * kv.token_bytes, 4 * state.seq_bytes
    need = 256 // 16 + 1
    budget = need * per_block + 5 * per_slot + 100           # one full sequence and 5 states
    plan = plan_kv_cache(kinds=HYBRID, block_size=16, max_model_len=256, max_num_seqs=64, budget_bytes=budget,
                         num_blocks_override=None)
    assert plan.seq_slots == 5 and plan.seqs_asked == 64 and plan.total_bytes <= budget
    assert "max_num_seqs=64 clamped" in plan.describe(256)
    roomy = plan_kv_cache(kinds=HYBRID, block_size=16, max_model_len=256, max_num_seqs=4, budget_bytes=budget,
                          num_blocks_override=None)
    assert roomy.seq_slots == 4 and roomy.seqs_asked == 0
    with pytest.raises(ValueError, match="one sequence's state"):
        plan_kv_cache(kinds=HYBRID, block_size=16, max_model_len=256, max_num_seqs=4,
                      budget_bytes=need * per_block + per_slot - 1, num_blocks_override=None)
    # Without a budget the CPU default holds the states too.
    default = plan_kv_cache(kinds=HYBRID, block_size=16, max_model_len=256, max_num_seqs=4, budget_bytes=None,
                            num_blocks_override=None)
    assert default.seq_slots == 4 and default.total_bytes <= kv_budget.CPU_DEFAULT_KV_BYTES


def test_a_cache_kind_stores_per_token_or_per_sequence():
    with pytest.raises(ValueError, match="either per token or per sequence"):
        kv_budget.CacheKind("x", 2, token_bytes=4, seq_bytes=4)
    with pytest.raises(ValueError, match="num_layers must be positive"):
        kv_budget.CacheKind("x", 0, token_bytes=4)
