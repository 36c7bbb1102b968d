"""host_memory.py: the weights the CPU backend holds live in 2 MiB pages (one advised
mapping the device arrays alias), the arrays' values unchanged."""

import jax
import numpy as np
import pytest

from jaxllm import host_memory
from jaxllm.quant import PackedWeight


def _mapping(address: int) -> dict:
    """The /proc/self/smaps entry holding ``address``: its range and AnonHugePages (KiB)."""
    entry = None
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                lo, hi = (int(v, 16) for v in head.split("-"))
                entry = {"lo": lo, "hi": hi, "huge_kb": 0} if lo <= address < hi else None
            elif entry is not None and head == "AnonHugePages:":
                entry["huge_kb"] = int(line.split()[1])
                return entry
    raise AssertionError(f"no mapping holds {address:#x}")


def _need_huge_pages():
    if not host_memory.huge_pages_possible():
        pytest.skip("transparent huge pages are off on this machine (or it is not Linux): nothing to back")


def test_arrays_copied_into_one_huge_page_mapping():
    _need_huge_pages()
    rng = np.random.default_rng(0)
    tree = {"w": rng.standard_normal((300, 7)).astype(np.float32),
            "packed": PackedWeight(d=rng.integers(0, 2**16, (5, 3), dtype=np.uint16),
                                   m=rng.integers(0, 2**16, (5, 3), dtype=np.uint16),
                                   qs=rng.integers(0, 256, (5, 3, 16), dtype=np.uint8), type_name="Q4_1", shape=(5, 96)),
            "odd": np.arange(3, dtype=np.int8)[::-1], "name": "kept"}
    got = host_memory.in_huge_pages(tree)
    assert jax.tree.structure(got) == jax.tree.structure(tree)
    for a, b in zip(jax.tree.leaves(tree), jax.tree.leaves(got)):
        if isinstance(a, np.ndarray):
            assert b.dtype == a.dtype and b.shape == a.shape and np.array_equal(a, b)
            assert b.ctypes.data % host_memory.ALIGN == 0
        else:
            assert b is a
    maps = [_mapping(a.ctypes.data) for a in jax.tree.leaves(got) if isinstance(a, np.ndarray)]
    assert len({(m["lo"], m["hi"]) for m in maps}) == 1, "the arrays are not in one mapping"
    assert maps[0]["huge_kb"] >= 2048, f"no 2 MiB page backs the weights' mapping: {maps[0]}"


def test_engine_weights_live_in_huge_pages(tiny_llm):
    """The product path: a CPU engine's device weights alias the advised mapping (the CPU
    backend did not copy them into its own 4 KiB-paged heap)."""
    _need_huge_pages()
    leaves = jax.tree.leaves(tiny_llm.llm_engine.core.runner.params)
    maps = {(m["lo"], m["hi"], m["huge_kb"]) for m in (_mapping(a.unsafe_buffer_pointer()) for a in leaves)}
    assert len(maps) == 1, f"the weights are spread over {len(maps)} mappings"
    (_, _, huge_kb), = maps
    assert huge_kb >= 2048, "the weights' mapping has no 2 MiB page"
