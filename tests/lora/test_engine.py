"""LoRA in the engine (jaxllm/lora/ through runner, scheduler and LLM): token-exact against
transformers + peft, on the native CPU path and on the XLA path (scanned layers), through the
Pallas LoRA kernel (interpret mode, a few tokens), and for Gemma 2, Gemma 3 and Qwen3-MoE (32 tokens,
one engine each; the MoE adapters change attention, its experts are no target); a batch
mixing adapters and the base equals each request alone; slots evicted, reloaded and unloaded
without compiling; the prefix cache keyed by adapter; bad adapters refused, the engine serving on;
``lora_dtype="bfloat16"`` token-exact against peft with the adapters rounded to bfloat16.

The adapters (tests/support/lora_adapters.py) have random non-zero B and ranks 4 and 8; the
native engine has max_loras=2 so a third adapter evicts one."""

from __future__ import annotations

import gguf
import jax
import ml_dtypes
import numpy as np
import pytest

from support.engines import ONE_SHOT_ENGINE
from support.lora_adapters import ATTENTION_ADAPTERS, bf16_rounded, build_set, edit_config, hf_greedy
from support.tiny_families import build_family
from support.tiny_models import build_tiny, write_gguf

from jaxllm import LLM, LoRARequest, SamplingParams
from jaxllm.engine.processor import InputProcessor
from jaxllm.lora.slots import LoRASlotArrays
from jaxllm.runner import compile as cc

N = 8   # greedy tokens compared with transformers + peft (each adapter changes the first few)
ENGINE = {**ONE_SHOT_ENGINE, "max_num_seqs": 8, "max_num_batched_tokens": 64, "skip_tokenizer_init": True,
          "enable_lora": True, "max_loras": 2, "max_lora_rank": 8}
BACKENDS = {"native": dict(cpu_matmul="native"),
            "xla": dict(cpu_matmul="xla", attention_backend="xla", scan_layers=True),
            # The step's attention on Pallas: the LoRA delta is pallas/lora.py's kernel too.
            "pallas": dict(cpu_matmul="xla", attention_backend="pallas", scan_layers=True)}
N_PALLAS = 1   # interpret mode runs every kernel program as a loop iteration: the prefill's token only
# Another dense family and one MoE family, 32 greedy tokens each: (base builder, adapters, backend).
NF = 32
FAMILIES = {
    "gemma2": (lambda d: build_family("gemma2", d), None, dict(cpu_matmul="native")),
    # Gemma 3: sliding and global layers, q/k norms, its own rope per layer kind.
    "gemma3": (lambda d: build_family("gemma3", d), None, dict(cpu_matmul="xla", attention_backend="xla")),
    "qwen3_moe": (lambda d: build_tiny("qwen3_moe", d), ATTENTION_ADAPTERS,
                  dict(cpu_matmul="xla", attention_backend="xla")),
}
PROMPTS = [np.random.default_rng(s).integers(3, 5000, size=n).tolist() for s, n in ((1, 5), (2, 11))]
GREEDY = SamplingParams(temperature=0, max_tokens=N, ignore_eos=True)


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    return build_set(str(tmp_path_factory.mktemp("lora_engine")))


@pytest.fixture(scope="module")
def loras(paths):
    return {name: LoRARequest(name, i + 1, paths[name]) for i, name in enumerate(("a4", "b8", "c8"))}


@pytest.fixture(scope="module")
def reference(paths):
    """(adapter name or None, prompt index) -> transformers + peft's greedy tokens."""
    return hf_greedy(paths["base"], {n: n and paths[n] for n in (None, "a4", "b8", "c8")}, PROMPTS, N)


_engines: dict[str, LLM] = {}


@pytest.fixture(scope="module")
def engine(paths):
    def get(backend: str) -> LLM:
        if backend not in _engines:
            _engines[backend] = LLM(paths["base"], **ENGINE, **BACKENDS[backend])
        return _engines[backend]
    yield get
    _engines.clear()


def run(llm, items, params=GREEDY):
    """items: (adapter LoRARequest or None, prompt index) -> token ids, all in one generate."""
    outs = llm.generate([{"prompt_token_ids": PROMPTS[i]} for _, i in items], params,
                        lora_request=[lr for lr, _ in items], use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_one_batch_of_two_ranks_and_the_base_matches_transformers_peft(backend, engine, loras, reference):
    items = [(None if n is None else loras[n], i) for n in (None, "a4", "b8") for i in range(len(PROMPTS))]
    n = N_PALLAS if backend == "pallas" else N
    got = run(engine(backend), items, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    for (lr, i), toks in zip(items, got):
        want = reference[(lr and lr.lora_name, i)][:n]
        assert toks == want, f"{backend}: adapter {lr and lr.lora_name}, prompt {i}"
    if backend == "pallas":   # the adapters do change these first tokens
        assert len({tuple(t) for t in got[:len(PROMPTS)]} | {tuple(t) for t in got[len(PROMPTS):]}) > len(PROMPTS)
    if backend == "native":   # these tokens came through cpu/lora.cc, not the XLA loop over the used slots
        r = engine(backend).llm_engine.core.runner
        hlo = r.compiler.lower_step(r.params, r.kv, r.sampler_rows.state, 16, 2).as_text()
        assert "jaxllm_lora_add_f32" in hlo


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    """name -> (paths, LoRARequests, transformers + peft's 32 greedy tokens, the engine), built once."""
    built = {}

    def get(name):
        if name not in built:
            build, adapters, backend = FAMILIES[name]
            paths = build_set(str(tmp_path_factory.mktemp(f"lora_{name}")), build=build, adapters=adapters)
            loras = {n: LoRARequest(n, i + 1, paths[n]) for i, n in enumerate(("a4", "b8"))}
            ref = hf_greedy(paths["base"], {n: n and paths[n] for n in (None, "a4", "b8")}, PROMPTS, NF)
            llm = LLM(paths["base"], **{**ENGINE, "max_num_seqs": 6}, **backend)
            built[name] = (paths, loras, ref, llm)
        return built[name]
    yield get
    built.clear()


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_other_families_match_transformers_peft(name, family):
    _, loras, reference, llm = family(name)
    items = [(None if n is None else loras[n], i) for n in (None, "a4", "b8") for i in range(len(PROMPTS))]
    got = run(llm, items, SamplingParams(temperature=0, max_tokens=NF, ignore_eos=True))
    for (lr, i), toks in zip(items, got):
        assert toks == reference[(lr and lr.lora_name, i)], f"{name}: adapter {lr and lr.lora_name}, prompt {i}"
    assert got[:len(PROMPTS)] != got[len(PROMPTS):2 * len(PROMPTS)]   # the adapters change the tokens


def test_moe_expert_targets_are_refused_by_name(family, tmp_path):
    # Qwen3-MoE's experts are no LoRA target here: an adapter listing them is refused naming
    # them (and what the model has); the engine serves on.
    paths, loras, reference, llm = family("qwen3_moe")
    bad = edit_config(paths["a4"], str(tmp_path / "bad"), target_modules=["q_proj", "v_proj", "o_proj", "experts"])
    with pytest.raises(ValueError, match="lora_path=") as e:
        llm.generate([{"prompt_token_ids": PROMPTS[0]}], GREEDY, lora_request=LoRARequest("bad", 9, bad),
                     use_tqdm=False)
    assert "['experts'] are not projections this model has" in str(e.value)
    assert not llm.llm_engine.has_unfinished_requests()


def test_a_mixed_batch_equals_each_request_alone(engine, loras):
    """Seeded sampling, each row drawn as it would be alone.  Greedy, a mixed batch equal to each
    request alone is the test above: its batch of six rows against transformers + peft run one
    request at a time."""
    llm = engine("native")
    # Five rows: their prefill (43 tokens) and decode steps run the buckets (64, 8) and (8, 8) the
    # test above compiled; alone, each runs the 1-row buckets the tests below run too.
    items = [(loras["a4"], 0), (None, 1), (loras["b8"], 1), (loras["a4"], 1), (loras["b8"], 0)]
    for params in (SamplingParams(temperature=1.0, seed=7, max_tokens=8, ignore_eos=True),):
        together = run(llm, items, params)
        alone = [run(llm, [it], params)[0] for it in items]
        assert together == alone


def test_eviction_reload_and_unload_never_compile(engine, loras, reference):
    # Every slot write (load, swap, unload) runs the writer compiled at warm-up: the engine's
    # strict guard fails a write that traces or compiles; here counted around one too.
    llm = engine("native")
    run(llm, [(loras["a4"], 0)])                       # its buckets compiled, a4 resident
    # Three adapters over two slots: one request waits for a slot, none fails.
    got = run(llm, [(loras["c8"], 0), (loras["a4"], 0), (loras["b8"], 0)])
    assert got == [reference[("c8", 0)], reference[("a4", 0)], reference[("b8", 0)]]
    assert run(llm, [(loras["c8"], 0)])[0] == reference[("c8", 0)]
    assert loras["a4"].lora_int_id not in llm.llm_engine.list_loras()  # evicted (least recently used)
    assert run(llm, [(loras["a4"], 0)])[0] == reference[("a4", 0)]   # loaded again
    before = cc.counts()
    assert llm.llm_engine.remove_lora(loras["a4"].lora_int_id)
    assert loras["a4"].lora_int_id not in llm.llm_engine.list_loras()
    assert run(llm, [(loras["a4"], 0)])[0] == reference[("a4", 0)]   # read again from its folder
    after = cc.counts()
    assert (after["traces"], after["compiles"]) == (before["traces"], before["compiles"])


def test_prefix_cache_is_keyed_by_adapter(engine, loras, reference):
    llm = engine("native")
    prompt = np.random.default_rng(5).integers(3, 5000, size=40).tolist()   # two full blocks
    one = dict(prompt_token_ids=prompt)
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    llm.generate([one], params, use_tqdm=False)
    again = llm.generate([one], params, use_tqdm=False)[0]
    assert again.num_cached_tokens > 0
    with_a4 = llm.generate([one], params, lora_request=loras["b8"], use_tqdm=False)[0]
    assert with_a4.num_cached_tokens == 0


def test_bad_adapters_are_refused_and_the_engine_serves_on(engine, loras, paths, reference, tmp_path):
    llm = engine("native")
    dora = edit_config(paths["a4"], str(tmp_path / "dora"), use_dora=True)
    for bad, message in ((LoRARequest("dora", 9, dora), "use_dora"),
                         (LoRARequest("gone", 10, str(tmp_path / "gone")), "no such folder")):
        with pytest.raises(ValueError, match="lora_path=") as e:
            llm.generate([{"prompt_token_ids": PROMPTS[0]}], GREEDY, lora_request=bad, use_tqdm=False)
        assert message in str(e.value)
        with pytest.raises(ValueError, match=message):   # the engine's own add_request checks it too
            llm.llm_engine.add_request("bad", {"prompt_token_ids": PROMPTS[0]}, GREEDY, lora_request=bad)
    assert not llm.llm_engine.has_unfinished_requests()
    assert run(llm, [(loras["a4"], 1)])[0] == reference[("a4", 1)]


def test_bfloat16_slots_equal_peft_with_the_adapters_rounded_to_bfloat16(engine, paths, loras, tmp_path_factory):
    """``lora_dtype="bfloat16"``: the slots hold each adapter rounded to bfloat16 and the shrink
    and expand run in float32, so the tokens are transformers + peft's (float32) with the
    adapter's ``lora_A``/``lora_B`` rounded to bfloat16: token-exact on the tiny model, 8
    tokens.  (a4 and c8: scales 2 and 0.5, so rounding B with the scale folded in, as the
    engine does, rounds peft's B alike; b8's rsLoRA scale is no power of two.)"""
    root = tmp_path_factory.mktemp("lora_bf16")
    rounded = {n: bf16_rounded(paths[n], str(root / n)) for n in ("a4", "c8")}
    ref = hf_greedy(paths["base"], rounded, PROMPTS, N)
    llm = LLM(paths["base"], **{**ENGINE, "max_num_seqs": 4}, **BACKENDS["native"], lora_dtype="bfloat16")
    runner = llm.llm_engine.core.runner
    mats = lambda slots: jax.tree.leaves({k: slots.weights[k] for k in ("A", "B")})   # noqa: E731
    assert {str(w.dtype) for w in mats(runner.lora_slots)} == {"bfloat16"}
    # "auto" (the default) is the model's dtype: float32 here
    assert {str(w.dtype) for w in mats(engine("native").llm_engine.core.runner.lora_slots)} == {"float32"}
    items = [(loras[n], i) for n in ("a4", "c8") for i in range(len(PROMPTS))]
    for (lr, i), toks in zip(items, run(llm, items)):
        assert toks == ref[(lr.lora_name, i)], f"adapter {lr.lora_name}, prompt {i}"
    # q/k/v's A side by side, gate/up's too (one shrink dot each: lora/apply.py)
    assert sorted(runner.lora_slots.weights["A"]) == ["down", "gate+up", "o", "q+k+v"]
    # What a slot holds: the adapter's float32 weights (scale folded) rounded to bfloat16.
    w = llm.llm_engine.core.lora_store.get(loras["c8"])
    one = LoRASlotArrays(runner.lora_slots.targets, runner.lora_slots.L, 1, 8, runner._rep, dtype="bfloat16")
    one.write(0, w)
    assert int(one.weights["rank"][0]) == w.rank == 8    # the slot's rank: cpu/lora.cc reads B's rows up to it
    for name, (a, b) in w.weights.items():
        key = one.group_of(name)
        A = np.asarray(one.weights["A"][key][0].astype("float32"))        # [L, in, n*8]: the group's
        B = np.asarray(one.weights["B"][name][0].astype("float32"))       # [L, 8, out]
        i = one.groups[key].index(name)
        A = A[..., i * 8:(i + 1) * 8]
        assert np.array_equal(A[..., :w.rank], a.astype(ml_dtypes.bfloat16).astype(np.float32)), name
        assert np.array_equal(B[:, :w.rank], b.astype(ml_dtypes.bfloat16).astype(np.float32)), name
        assert not A[..., w.rank:].any()


def test_lora_request_needs_enable_lora(loras):
    # The input processor of an engine started without enable_lora (no adapter store).
    processor = InputProcessor(None, 1000, 64, (2,), 0)
    with pytest.raises(ValueError, match="enable_lora"):
        processor.process_inputs("0", [5, 6], GREEDY, lora_request=loras["a4"])


def test_packed_gguf_base_with_a_float_adapter(paths, loras, tmp_path):
    # Q8_0 blocks kept packed (the native quantized matmul), the adapter's delta in float32:
    # the same tokens as the same file dequantized to float, and the adapter changes them.
    path = str(tmp_path / "base_q8_0.gguf")
    write_gguf(paths["base"], path, matrix_type=gguf.GGMLQuantizationType.Q8_0)
    prompt = [{"prompt_token_ids": PROMPTS[0]}]
    params = SamplingParams(temperature=0, max_tokens=N, ignore_eos=True)
    got = {}
    for dequantize in (False, True):
        # The shared engine's settings (auto resolves to the native matmul): the dequantized
        # engine's programs are the native engine's (cache hits); the packed one compiles its
        # own step programs only.
        llm = LLM(path, **ENGINE, dequantize=dequantize)
        got[dequantize] = [llm.generate(prompt, params, lora_request=lr, use_tqdm=False)[0].outputs[0].token_ids
                           for lr in (None, loras["b8"])]
    assert got[False] == got[True]
    assert got[False][0] != got[False][1]
