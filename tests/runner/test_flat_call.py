"""runner/flat_call.py: a compiled step called on flat arrays gives the compiled object's
outputs, donates as it does, and falls back to its call where it must."""

import jax
import numpy as np
import pytest

from jaxllm.runner.flat_call import FlatProgram, Leaves


def _copies(tree):
    return jax.tree.map(lambda a: jax.device_put(np.asarray(a), a.sharding), tree)


def _step_args(runner, program, words_on_device: bool):
    """A step's arguments as the runner hands them (fresh copies of the donated KV cache and
    sampler state), the packed input vector made of small ids."""
    words_aval = jax.tree.leaves(program.compiled.in_avals[0])[-1]
    words = (np.arange(words_aval.size) % 7).astype(words_aval.dtype)
    if words_on_device:
        words = jax.device_put(words)
    return _copies(runner.kv), _copies(runner.sampler_rows.state), words


def _bits(tree):
    return [np.asarray(x).tobytes() for x in jax.tree.leaves(tree)]


@pytest.mark.parametrize("words_on_device", [False, True], ids=["host-words", "device-words"])
def test_flat_step_is_the_compiled_steps_bits_and_donates(tiny_llm, words_on_device):
    runner = tiny_llm.llm_engine.core.runner
    program = runner.compiler.steps[(1, 1)]
    # The installed JAX takes the fast path (else this file would test the fallback only).
    assert program.fast, "FlatProgram fell back to the compiled call on this JAX (see runner/flat_call.py)"
    kv, state, words = _step_args(runner, program, words_on_device)
    want = program.compiled(runner.params, kv, state, words)
    kv, state, words = _step_args(runner, program, words_on_device)
    got = program(Leaves.of(runner.params), kv, state, words)
    assert jax.tree.structure(got) == jax.tree.structure(want)
    assert _bits(got) == _bits(want)
    # The KV cache and the sampler state are donated (updated in place), as by the compiled call.
    assert all(a.is_deleted() for a in jax.tree.leaves((kv, state)))
    assert not any(a.is_deleted() for a in jax.tree.leaves(runner.params))


def test_sampler_takes_the_same_path(tiny_llm):
    assert all(p.fast for p in tiny_llm.llm_engine.core.runner.compiler.samplers.values())


def test_debug_nans_falls_back_to_the_compiled_call(tiny_llm):
    """``jax_debug_nans`` checks each output: only the compiled object's call does."""
    runner = tiny_llm.llm_engine.core.runner
    program = runner.compiler.steps[(1, 1)]
    kv, state, words = _step_args(runner, program, False)
    want = program.compiled(runner.params, kv, state, words)
    with jax.debug_nans(True):
        assert not program.fast
        kv, state, words = _step_args(runner, program, False)
        got = program(Leaves.of(runner.params), kv, state, words)
    assert program.fast
    assert _bits(got) == _bits(want)


def test_a_wrong_argument_is_refused_before_anything_runs(tiny_llm):
    runner = tiny_llm.llm_engine.core.runner
    program = runner.compiler.steps[(1, 1)]
    kv, state, words = _step_args(runner, program, False)
    n = len(jax.tree.leaves(program.compiled.in_avals[0])) - 1
    with pytest.raises(ValueError, match=rf"argument {n}: uint32\[{words.size + 1}\] where the program takes "
                                         rf"uint32\[{words.size}\]"):
        program(Leaves.of(runner.params), kv, state, np.zeros(words.size + 1, np.uint32))
    with pytest.raises(ValueError, match=rf"{n} arrays where the program takes {n + 1}"):
        program(Leaves.of(runner.params), kv, state)      # the input vector left out
    assert not any(a.is_deleted() for a in jax.tree.leaves((kv, state)))


def test_a_program_with_effects_keeps_the_compiled_call():
    """A program JAX runs with effects (here a host callback) is not handed flat arrays."""
    def f(x):
        jax.debug.callback(lambda v: None, x)
        return x + 1

    compiled = jax.jit(f).lower(jax.ShapeDtypeStruct((3,), np.float32)).compile()
    program = FlatProgram(compiled)
    assert not program.fast
    np.testing.assert_array_equal(program(np.ones(3, np.float32)), np.full(3, 2, np.float32))


def test_arguments_xla_dropped_are_not_handed_over():
    """jit drops unused arguments (``keep_unused=False``): the executable takes the others."""
    def f(a, unused, b):
        return {"y": a * 2 + b}

    spec = jax.ShapeDtypeStruct((4,), np.float32)
    program = FlatProgram(jax.jit(f).lower(spec, spec, spec).compile())
    assert program.fast
    a, unused, b = (np.arange(4, dtype=np.float32) + k for k in (0, 10, 20))
    out = program(Leaves.of(jax.device_put(a)), unused, b)   # a host array placed, the dropped one not
    np.testing.assert_array_equal(out["y"], a * 2 + b)
