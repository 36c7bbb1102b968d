"""GGUF files of Gemma 2/3, Phi-3, SmolLM3, OLMo 2/3, Granite, GLM-4-MoE and GPT-OSS
(each family's ``config.py``, ``from_gguf``) against their safetensors twins.

Each tiny random checkpoint (every option llama.cpp's GGUF can carry switched on; what it
cannot, such as Gemma's query_pre_attn_scalar or GPT-OSS's SwiGLU limit, left at the value
llama.cpp fixes) is written as llama.cpp's converter writes it (``tests/support/gguf_convert.py``:
Q/K permutations, Gemma's ``+1`` norms, fused and split tensors, the metadata), then:

* F32 GGUF: the config and every weight equal to the twin's load, float32 prompt logits
  (40 tokens, past every sliding window) within 1e-4 relative of transformers on the twin,
  and 16 greedy tokens equal to the twin's through the same compiled step;
* Q8_0 GGUF (every matrix in blocks): the packed blocks dequantize to the dequantized load of
  the same file, whose every weight is the F32 file's within Q8_0's rounding bound; for three
  families the packed forward computes the dequantized load's logits (1e-5).  (Against transformers on the unrounded weights this chaotic random model
  moves by 2e-2 to 1.2 of the logits' range, MoE routing flips included: no bound there would
  be a test of anything.)
* loading: a missing tensor is named by its GGUF name; an unknown metadata key is refused by name.

XLA path only: the kernels are the safetensors path's, tested in the families' own files.
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest
import torch
from support.gguf_convert import write_gguf
from support.tiny_families import FAMILY_VARIANTS
from support.tiny_models import BASE, VARIANTS_B, build_tiny, load_hf

from jaxllm.errors import ModelLoadError
from jaxllm.models.loader import load_model

# The families' tiny variants, adjusted only where llama.cpp fixes a value its GGUF cannot carry.
GGUF_VARIANTS = {
    "gemma2": (FAMILY_VARIANTS["gemma2"][0], {**FAMILY_VARIANTS["gemma2"][1], "query_pre_attn_scalar": 16}),
    # llama.cpp's Gemma 3 pattern: five sliding layers, then a global one.
    "gemma3": (FAMILY_VARIANTS["gemma3"][0], {**FAMILY_VARIANTS["gemma3"][1], "query_pre_attn_scalar": 32,
                                              "num_hidden_layers": 6,
                                              "layer_types": ["sliding_attention"] * 5 + ["full_attention"]}),
    "gpt_oss": (FAMILY_VARIANTS["gpt_oss"][0], {**FAMILY_VARIANTS["gpt_oss"][1], "swiglu_limit": 7.0}),
    "phi3": VARIANTS_B["phi3"],
    # llama.cpp's SmolLM3: NoPE on every 4th layer.
    "smollm3": (VARIANTS_B["smollm3"][0], {**VARIANTS_B["smollm3"][1], "no_rope_layer_interval": 4}),
    "olmo2": VARIANTS_B["olmo2"],
    "olmo3": VARIANTS_B["olmo3"],
    "granite": VARIANTS_B["granite"],
    "glm4_moe": VARIANTS_B["glm4_moe"],
}

PROMPT_LEN, GREEDY = 40, 16


def prompt_ids(n: int, seed: int = 1) -> list[int]:
    return np.random.default_rng(seed).integers(3, 5000, size=n).tolist()


@pytest.fixture(scope="module")
def twins(tmp_path_factory):
    """variant -> (HF folder, F32 GGUF path, Q8_0 GGUF path)."""
    import gguf

    from jaxllm.config import default_cache_dir
    from jaxllm.runner import compile as cc
    cc.enable_persistent_cache(os.path.join(default_cache_dir(), "xla"))   # as an engine runs
    root = tmp_path_factory.mktemp("gguf_families")
    out = {}
    for v in GGUF_VARIANTS:
        hf = build_tiny(v, str(root / v), variants=GGUF_VARIANTS)
        out[v] = (hf, write_gguf(hf, str(root / f"{v}.gguf")),
                  write_gguf(hf, str(root / f"{v}-q8_0.gguf"), matrix_type=gguf.GGMLQuantizationType.Q8_0))
    return out


_STEPS: dict = {}


class Runner:
    """A model's forward over a paged cache, compiled once per shape: the prompt in one
    chunk, then one token at a time."""

    def __init__(self, model, max_len: int, block: int = 16):
        import jax
        import jax.numpy as jnp

        from jaxllm.models.kernels import Kernels
        from jaxllm.models.registry import get_model_module
        from jaxllm.runner.weights import allocate_kv_cache, to_device_params
        arch = self.arch = model.arch
        self.params = to_device_params(model, jnp.float32, False, packed_bf16=False, native=False)
        self.block = block
        n_blocks = -(-max_len // block)
        self.table = np.random.default_rng(0).permutation(n_blocks + 3)[:n_blocks].astype(np.int32)
        self.kv = allocate_kv_cache(arch.num_layers, n_blocks + 3, block, arch.num_kv_heads, arch.head_dim,
                                    jnp.float32, stacked=False)
        if arch not in _STEPS:   # one jitted step per config: same-typed weights share its compilations
            module = get_model_module(arch.architecture)
            kernels = Kernels(matmul="xla", attention="xla")

            def step(p, kv, ids, md):
                hidden, kv = module.forward(arch, p, kv, ids, md, kernels)
                return module.compute_logits(arch, p, hidden, kernels), kv
            _STEPS[arch] = jax.jit(step)
        self.step = _STEPS[arch]

    def run(self, ids: list[int], start: int) -> np.ndarray:
        from jaxllm.layers.attention import AttentionMetadata
        pos = np.arange(start, start + len(ids), dtype=np.int32)
        b = self.block
        md = AttentionMetadata(
            positions=pos, slot_mapping=(self.table[pos // b] * b + pos % b).astype(np.int32),
            token_seq=np.zeros(len(ids), np.int32), block_tables=self.table[None, :],
            seq_lens=np.array([start + len(ids)], np.int32), query_start_loc=np.array([0, len(ids)], np.int32))
        logits, self.kv = self.step(self.params, self.kv, np.asarray(ids, np.int32), md)
        return np.asarray(logits)

    def greedy(self, prompt: list[int], n: int) -> tuple[np.ndarray, list[int]]:
        """(the prompt's logits, n greedy tokens)."""
        logits = self.run(prompt, 0)
        out = [int(logits[-1].argmax())]
        for i in range(n - 1):
            out.append(int(self.run([out[-1]], len(prompt) + i)[-1].argmax()))
        return logits, out


def _hf_logits(hf_path: str, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return load_hf(hf_path)(torch.tensor([ids])).logits[0].numpy()


def _f32(x):
    """``x`` with every float (also inside tuples and nested dataclasses) rounded to float32."""
    if dataclasses.is_dataclass(x):
        return tuple((f.name, _f32(getattr(x, f.name))) for f in dataclasses.fields(x))
    if isinstance(x, tuple):
        return tuple(_f32(v) for v in x)
    return float(np.float32(x)) if isinstance(x, float) else x


def _rel(a, b) -> float:
    return float(np.abs(a - b).max() / np.abs(b).max())


def _params(model):
    """(where, name, array) of every parameter of a LoadedModel."""
    out = [("global", k, w) for k, w in model.globals.items()]
    for i, lp in enumerate(model.layers):
        out += [(f"layer {i}", k, w) for k, w in lp.items()]
    return out


# Q8_0's packed forward runs for the architectures whose undoing is a row operation on the
# blocks (fused splits, Q/K permutation) and for an MoE whose experts are dequantized; the
# others check the packed blocks against the dequantized load weight by weight.
PACKED_FORWARD = ("phi3", "granite", "gpt_oss")


@pytest.mark.parametrize("variant", sorted(GGUF_VARIANTS))
def test_gguf_matches_the_safetensors_twin(variant, twins):
    hf_path, f32, q8 = twins[variant]
    ids = prompt_ids(PROMPT_LEN)
    model, twin = load_model(f32), load_model(hf_path)
    # The same config, but for the tokenizer's ids (the GGUF here carries no vocabulary) and
    # GGUF's float32 metadata (the eps, LongRoPE's factors).
    assert _f32(dataclasses.replace(model.arch, bos_token_id=twin.arch.bos_token_id,
                                    eos_token_ids=twin.arch.eos_token_ids)) == _f32(twin.arch), variant
    # Every weight back in the twin's layout: equal (Gemma's norms: the converter's + 1 undone,
    # float32 rounding).
    got, want = _params(model), _params(twin)
    assert sorted((w, k) for w, k, _ in got) == sorted((w, k) for w, k, _ in want), variant
    want_by = {(w, k): a for w, k, a in want}
    for where, k, a in got:
        np.testing.assert_allclose(a, want_by[where, k], rtol=0, atol=1e-6, err_msg=f"{variant} {where} {k}")

    # Logits against transformers; greedy tokens against the twin's (the families' own tests
    # hold those equal to transformers' generate); one compiled step serves both.
    n = PROMPT_LEN + GREEDY
    logits, tokens = Runner(model, n).greedy(ids, GREEDY)
    rel = _rel(logits, _hf_logits(hf_path, ids))
    assert rel < 1e-4, f"{variant} F32 GGUF: max relative logit error {rel:.2e} against transformers"
    _, twin_tokens = Runner(twin, n).greedy(ids, GREEDY)
    assert tokens == twin_tokens, f"{variant} F32 GGUF greedy differs from the safetensors twin's"

    # Q8_0: matrices kept in their blocks, the row operations (Q/K permutation, fused splits)
    # applied to every field of them, dequantize to exactly the dequantized load's weights,
    # and each of those is the F32 file's within Q8_0's rounding: half a step of d = amax / 127
    # of its block (bounded here by the tensor's largest magnitude), plus d's float16 rounding
    # over 127 steps; norms, biases and sinks (kept F32) exactly.
    from jaxllm.models.loader import load_gguf
    from jaxllm.quant import PackedWeight, dequantize
    packed, dequantized = load_model(q8), load_gguf(q8, dequantize=True)
    assert isinstance(packed.layers[0]["o"], PackedWeight), "Q8_0 matrices should stay in their blocks"
    f32_by = {(w, k): a for w, k, a in got}
    for (where, k, p), (_, _, d) in zip(_params(packed), _params(dequantized)):
        if isinstance(p, PackedWeight):
            np.testing.assert_array_equal(np.asarray(dequantize(p)), d, err_msg=f"{variant} {where} {k}")
        w = f32_by[where, k]
        if w.ndim == 1:
            np.testing.assert_array_equal(d, w, err_msg=f"{variant} {where} {k}")
        else:
            bound = np.abs(w).max() / 127 * (0.5 + 127 * 2.0 ** -11)
            err = np.abs(d - w).max()
            assert 0 < err <= bound, f"{variant} {where} {k}: Q8_0 error {err:.3g}, bound {bound:.3g}"
    if variant in PACKED_FORWARD:   # the packed forward computes the dequantized weights' logits
        q_rel = _rel(Runner(packed, n).run(ids, 0), Runner(dequantized, n).run(ids, 0))
        assert q_rel < 1e-5, f"{variant} Q8_0 packed vs dequantized: {q_rel:.2e}"


# ----------------------------------------------------------------------------- loading errors

@pytest.mark.parametrize("variant,drop", [
    ("gpt_oss", "blk.1.attn_sinks.weight"),          # sinks
    ("gpt_oss", "blk.0.ffn_up_exps.weight"),         # one half of the interleaved expert pair
    ("gemma2", "blk.2.post_ffw_norm.weight"),        # a soft-capped Gemma's norm
    ("gemma3", "blk.0.attn_k_norm.weight"),          # soft-cap-free Gemma's q/k norm
    ("phi3", "blk.1.attn_qkv.weight"),               # fused qkv
    ("phi3", "rope_factors_short.weight"),           # LongRoPE factors
    ("glm4_moe", "blk.2.exp_probs_b.bias"),          # router correction bias
    ("olmo2", "blk.0.attn_q_norm.weight"),
])
def test_missing_tensor_is_named(variant, drop, twins, tmp_path):
    path = write_gguf(twins[variant][0], str(tmp_path / "broken.gguf"), drop=drop)
    with pytest.raises(ModelLoadError, match=rf"missing tensor '{drop.replace('.', '[.]')}'"):
        load_model(path)


@pytest.mark.parametrize("variant,key", [
    ("gemma2", "gemma2.rope.scaling.type"),
    ("granite", "granite.attention.clamp_kqv"),
    ("gpt_oss", "gpt-oss.swiglu_clamp_exp"),
    ("smollm3", "smollm3.attention.sliding_window"),
])
def test_unknown_metadata_key_is_refused_by_name(variant, key, twins, tmp_path):
    path = write_gguf(twins[variant][0], str(tmp_path / "extra.gguf"), extra={key: 1.5})
    with pytest.raises(ModelLoadError, match=rf"{key.replace('.', '[.]')}' is not supported"):
        load_model(path)


def test_gemma_attention_scale_key_is_the_softmax_scale(twins, tmp_path):
    """llama.cpp derives Gemma's softmax scale from the model size; a file that carries
    ``attention.scale`` states it (the checkpoint's query_pre_attn_scalar ** -0.5)."""
    path = write_gguf(twins["gemma2"][0], str(tmp_path / "scaled.gguf"), extra={"gemma2.attention.scale": 0.125})
    assert load_model(path).arch.attn_scale == 0.125
    assert load_model(twins["gemma2"][1]).arch.attn_scale == 16 ** -0.5


def test_sliding_window_pattern_becomes_layer_types(twins):
    """OLMo 3 (written as olmo2): the sliding_window_pattern array gives each layer's kind;
    Gemma 3 without it takes llama.cpp's fixed pattern (every 6th layer global)."""
    olmo3 = load_model(twins["olmo3"][1]).arch
    assert olmo3.architecture == "Olmo3ForCausalLM"
    assert olmo3.layer_types == ("sliding_attention", "full_attention") and olmo3.sliding_window == 16
    assert load_model(twins["olmo2"][1]).arch.architecture == "Olmo2ForCausalLM"
    gemma3 = load_model(twins["gemma3"][1]).arch
    assert gemma3.layer_types == ("sliding_attention",) * 5 + ("full_attention",)


def test_unexpected_tensor_is_named(twins, tmp_path):
    path = write_gguf(twins["granite"][0], str(tmp_path / "extra-tensor.gguf"),
                      extra_tensors={"blk.0.ffn_gate_inp.weight": np.zeros((4, BASE["hidden_size"]), np.float32)})
    with pytest.raises(ModelLoadError, match=r"unexpected tensor 'blk\.0\.ffn_gate_inp\.weight'"):
        load_model(path)


def test_glm4_moe_nextn_block_is_skipped(twins, tmp_path):
    """GLM-4-MoE's GGUF counts the multi-token-prediction block in block_count and holds its
    tensors (nextn.* and a decoder layer's) after the decoder's: skipped, as transformers does."""
    D = BASE["hidden_size"]
    extra = {"blk.3.nextn.eh_proj.weight": np.ones((D, 2 * D), np.float32),
             "blk.3.nextn.enorm.weight": np.ones(D, np.float32), "blk.3.attn_norm.weight": np.ones(D, np.float32)}
    got = load_model(write_gguf(twins["glm4_moe"][0], str(tmp_path / "nextn.gguf"), extra_tensors=extra))
    assert got.arch.num_layers == 3 and len(got.layers) == 3



def test_engine_serves_a_gguf_family(twins, smollm_tokenizer_dir):
    """GPT-OSS's GGUF (sinks, alternating windows, biased experts, YaRN) through the engine on
    its default backends: 16 greedy tokens equal to the safetensors twin's."""
    from support.engines import SMALL_ENGINE

    from jaxllm import LLM, SamplingParams
    hf_path, f32, _ = twins["gpt_oss"]
    ids = prompt_ids(PROMPT_LEN, seed=7)
    _, want = Runner(load_model(hf_path), PROMPT_LEN + GREEDY).greedy(ids, GREEDY)
    llm = LLM(f32, tokenizer=smollm_tokenizer_dir, **{**SMALL_ENGINE, "precompile": "auto", "max_num_batched_tokens": 64})
    out = llm.generate([{"prompt_token_ids": ids}], SamplingParams(temperature=0, max_tokens=GREEDY, ignore_eos=True),
                       use_tqdm=False)
    assert out[0].outputs[0].token_ids == want


# ----------------------------------------------------------------------------- metadata rules

def _fields(arch: str, L: int, **extra) -> dict:
    f = {"general.architecture": arch, f"{arch}.block_count": L, f"{arch}.embedding_length": 64,
         f"{arch}.feed_forward_length": 128, f"{arch}.attention.head_count": 4,
         f"{arch}.attention.head_count_kv": 2, f"{arch}.attention.key_length": 32,
         f"{arch}.attention.value_length": 32, f"{arch}.attention.layer_norm_rms_epsilon": 1e-6}
    return {**f, **{f"{arch}.{k}": v for k, v in extra.items()}}


_EMBED = {"token_embd.weight": (64, 1000)}


def arch_config(fields: dict, tensors: dict, gguf_arch: str, path: str):
    """The metadata read by the config type of the family the registry maps ``gguf_arch`` to."""
    from jaxllm.models.registry import GGUF_ARCHITECTURES, get_family
    return get_family(GGUF_ARCHITECTURES[gguf_arch]).config.from_gguf(fields, tensors, gguf_arch, path)


def test_gemma_metadata_follows_llama_cpp():
    """llama.cpp's Gemma rules where the file is silent: the 27B layer counts take
    (hidden / heads) ** -0.5 as the softmax scale, the others head_dim ** -0.5; Gemma 2's caps
    default to 50 / 30 and its window to 4096; Gemma 3 without a window is global everywhere."""
    big = arch_config(_fields("gemma2", 46), _EMBED, "gemma2", "f.gguf")
    assert big.attn_scale == (64 // 4) ** -0.5
    small = arch_config(_fields("gemma2", 26), _EMBED, "gemma2", "f.gguf")
    assert small.attn_scale == 32 ** -0.5
    assert (small.gemma.attn_soft_cap, small.gemma.final_soft_cap, small.sliding_window) == (50.0, 30.0, 4096)
    assert small.layer_types[:2] == ("sliding_attention", "full_attention")
    g3 = arch_config(_fields("gemma3", 62), _EMBED, "gemma3", "f.gguf")
    assert g3.attn_scale == 16 ** -0.5 and g3.layer_types == ("full_attention",) * 62
    assert g3.gemma.rope_local_theta == 10000.0 and g3.gemma.final_soft_cap is None and g3.vocab_size == 1000


def test_end_of_generation_ids_are_llama_cpps():
    """eos, eot and eom all end a generation (llama.cpp's end-of-generation set)."""
    fields = {**_fields("phi3", 2), "tokenizer.ggml.eos_token_id": 32000, "tokenizer.ggml.eot_token_id": 32007,
              "tokenizer.ggml.bos_token_id": 1}
    arch = arch_config(fields, _EMBED, "phi3", "f.gguf")
    assert arch.eos_token_ids == (32000, 32007) and arch.bos_token_id == 1


def test_per_layer_metadata_is_refused_by_name():
    fields = _fields("granite", 2)
    fields["granite.attention.head_count_kv"] = [2, 1]
    with pytest.raises(ModelLoadError, match=r"granite\.attention\.head_count_kv differs between layers"):
        arch_config(fields, _EMBED, "granite", "f.gguf")
    with pytest.raises(ModelLoadError, match=r"value_length \(16\) differs from key_length"):
        arch_config(_fields("olmo2", 2, **{"attention.value_length": 16}), _EMBED, "olmo2", "f.gguf")
