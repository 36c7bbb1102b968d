"""jaxllm/runner/packing.py: a step's inputs cross to the device as one uint32 vector and come
back bit for bit inside the compiled step; the engine's steps take exactly that one vector."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm.runner import packing


def _tree(rng):
    return {
        "ids": rng.integers(-2**31, 2**31 - 1, size=(7,), dtype=np.int32),
        "table": rng.integers(0, 1000, size=(3, 5), dtype=np.int32),
        "temps": np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 1e-38, 3.5], np.float32),
        "seeds": rng.integers(0, 2**32, size=(4,), dtype=np.uint32),
        "flags": np.array([True, False, True], np.bool_),
        "empty": np.zeros((0, 4), np.int32),
        "scalar": np.float32(-2.25),
    }


def test_pack_unpack_round_trip_is_bit_exact():
    host = _tree(np.random.default_rng(0))
    spec = jax.tree.map(lambda a: jax.ShapeDtypeStruct(np.shape(a), np.asarray(a).dtype), host)
    words = packing.pack(host)
    assert words.dtype == np.uint32 and words.shape == (packing.num_words(spec),)
    back = jax.jit(lambda w: packing.unpack(w, spec))(jnp.asarray(words))
    for name, a in host.items():
        b = np.asarray(back[name])
        a = np.asarray(a)
        assert b.dtype == a.dtype and b.shape == a.shape, name
        if a.dtype == np.bool_:
            np.testing.assert_array_equal(b, a)
        else:   # bit patterns: NaN, -0.0 and infinities survive
            np.testing.assert_array_equal(b.view(np.uint32), a.view(np.uint32), err_msg=name)


@pytest.mark.parametrize("dtype", [np.int64, np.float16, np.uint8])
def test_pack_refuses_other_widths(dtype):
    with pytest.raises(ValueError, match="32-bit and bool"):
        packing.pack({"x": np.zeros(3, dtype)})


def test_span_is_a_subtree_words():
    host = _tree(np.random.default_rng(1))
    tree = {"head": host["ids"], "mid": {"t": host["table"], "f": host["flags"]}, "tail": host["temps"]}
    spec = jax.tree.map(lambda a: jax.ShapeDtypeStruct(np.shape(a), np.asarray(a).dtype), tree)
    lo, hi = packing.span(spec, spec["mid"])
    assert (lo, hi) == (7, 7 + 15 + 3)
    np.testing.assert_array_equal(packing.pack(tree)[lo:hi], packing.pack(tree["mid"]))
    copy = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype), spec["mid"])   # equal, not the same
    with pytest.raises(ValueError, match="contiguous subtree"):
        packing.span(spec, copy)


def test_compiled_step_takes_one_input_vector(tiny_llama, monkeypatch):
    """The step's arguments are the weights, the KV cache, the sampler state and one vector;
    the sampler's, the state, the logits and the sampling part of that vector, which the step
    hands back on the device: a step packs and sends its inputs once."""
    from jaxllm import LLM, SamplingParams
    from support.engines import SMALL_ENGINE
    llm = LLM(model=tiny_llama, **SMALL_ENGINE)
    runner = llm.llm_engine.core.runner
    fixed = len(jax.tree.leaves(runner.params)) + len(jax.tree.leaves(runner.kv)) + len(jax.tree.leaves(runner.sampler_rows.state))
    for bucket, program in runner.compiler.steps.items():
        args = program.compiled.in_tree.num_leaves
        assert args == fixed + 1, f"bucket {bucket}: {args - fixed} input arrays per step, expected 1"
    # The sampler of each sequence bucket: the state, the step's logits, one vector and the
    # grammar bitmask (structured outputs).
    assert sorted(runner.compiler.samplers) == sorted({S for _, S in runner.buckets})
    state = len(jax.tree.leaves(runner.sampler_rows.state))
    for S, program in runner.compiler.samplers.items():
        args = program.compiled.in_tree.num_leaves
        assert args == state + 3, f"sampler {S}: {args - state - 2} input arrays besides the logits and the " \
                                  f"bitmask, expected 1"
    for (T, S), program in runner.compiler.steps.items():
        handed = jax.tree.leaves(program.compiled.out_info)[-1]
        assert handed.shape == jax.tree.leaves(runner.compiler.samplers[S].compiled.in_avals)[-2].shape, (T, S)
    packs, runs = [], []
    pack, run = packing.pack, runner._run
    monkeypatch.setattr(packing, "pack", lambda tree: packs.append(1) or pack(tree))
    monkeypatch.setattr(runner, "_run", lambda step: runs.append(step.bucket) or run(step))
    out = llm.generate(["hello there", "a longer prompt than the first"],
                       SamplingParams(temperature=0.8, seed=3, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in out] == [4, 4]
    assert len(runs) >= 4 and len(packs) == len(runs), f"{len(packs)} vectors packed in {len(runs)} steps"
