"""The order in which the suite's files reach the two test workers: the heaviest first.

pytest-xdist (``--dist loadfile``) hands whole files to whichever worker is free, in the
order it is given them.  Its default order is by number of tests, which puts files holding one
long test (an engine compiled for a whole workload) last: the other worker then idles while it
runs.  Longest first (``--no-loadscope-reorder`` in scripts/test.sh, the order below from
conftest) leaves the short files to fill the end.  Files not listed keep collection order after
these; a renamed file only loses its place.  The list is the item-seconds ranking of a
``--durations=0`` run, heaviest first; a file that run did not rank goes where its slowest item
of a later run's ``--durations=40`` puts it (at least that much time).  Then, measured per file in
CPU-s (one process, cold cache, December 2026, after the suite's XLA flags halved compile time):
test_qwen3_next_engine 61, test_builtin_int8 56, test_data_parallel 35, test_smollm2 34 (the
built-in engine's session setup included), test_spec_identity 31, test_device_check 27,
test_tensor_parallel 26, test_gdn_tp 25, test_tool_example 23, test_compile 22: the order was
kept where those agree with it, test_data_parallel and test_smollm2 moved up.
"""

from __future__ import annotations

HEAVIEST_FIRST = (
    "tests/models/test_qwen3_next_engine.py",
    "tests/quant/test_builtin_int8.py",
    "tests/spec_decode/test_spec_identity.py",
    "tests/quant/test_packed_engine.py",
    "tests/engine/test_kv_quant_engine.py",
    "tests/models/test_qwen3_next.py",
    "tests/lora/test_engine.py",
    "tests/quant/test_k_fixtures.py",
    "tests/models/test_gpt_oss.py",
    "tests/runner/test_compile.py",
    "tests/models/test_smollm2.py",
    "tests/parallel/test_tp_families.py",
    "tests/models/test_hf_parity.py",
    "tests/kernels/test_cpu_attention.py",
    "tests/models/test_hf_quantized.py",
    "tests/models/test_families_b.py",
    "tests/serve/test_data_parallel.py",
    "tests/parallel/test_tensor_parallel.py",
    "tests/parallel/test_gdn_tp.py",
    "tests/bench/test_device_check.py",
    "tests/test_hub.py",
    "tests/spec_decode/test_draft_kv.py",
    "tests/docs/test_snippets.py",
    "tests/kernels/test_ragged_paged_attention.py",
    "tests/models/test_deepseek.py",
    "tests/spec_decode/test_spec_identity_draft.py",
    "tests/parallel/test_lora_tp.py",
    "tests/parallel/test_mla_tp.py",
    "tests/engine/test_disposable_caches.py",
    "tests/quant/test_activations.py",
    "tests/sample/test_order_gate.py",
    "tests/test_startup.py",
    "tests/parallel/test_families_b_tp.py",
    "tests/kernels/test_gumbel_argmax.py",
    "tests/docs/test_tool_example.py",
    "tests/parallel/test_multihost.py",
    "tests/spec_decode/test_ngram_builtin.py",
    "tests/serve/test_lora_serve.py",
    "tests/docs/test_lora_notebook.py",
    "tests/runner/test_kv_in_place.py",
    "tests/models/test_gemma.py",
    "tests/engine/test_pallas_backend.py",
    "tests/models/test_gguf_families.py",
    "tests/bench/test_spec_decode_bench.py",
    "tests/docs/test_notebook.py",
)


def heaviest_first(items: list) -> None:
    """Sorts pytest items in place: listed files first, in the list's order; each file's
    tests keep their order (the sort is stable)."""
    rank = {path: i for i, path in enumerate(HEAVIEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(rank)))
