"""Gemma 2, Gemma 3 and GPT-OSS at tp=2 on simulated CPU devices equal one device; Gemma 3 and
Qwen3.5 with an image too.

The sharded runs happen in one subprocess (tp_families_probe.py).  For each tiny checkpoint
(tests/support/tiny_families.py): the prompt's logits within 1e-4 relative of tp=1 in float32 and 32
greedy tokens identical, on the XLA path and with the Pallas kernel per device (GPT-OSS's
sinks split with their heads; Gemma 2's soft-cap and window); and the weights really split.
The engine at tp=2 is family-blind and runs on other families (tp_families_probe.PALLAS's
comment says where).  (tp=1 against transformers, the engine included: tests/models/test_gemma.py,
test_gpt_oss.py.)

The vision-language models at tp=2, in the same process (support/vision_tp_probe.py): Gemma 3
(SigLIP tower + projector) and Qwen3.5 (2D-rotary ViT + patch merger; its text model cut to 2
layers, one GDN and one full attention, to compile less).  ``LLM(tensor_parallel_size=2)`` on the
XLA path under the strict compile guard, one image, 32 greedy tokens = transformers' greedy
choices (float32; one forward over the prompt and the tokens, ``_reference``) on the engine's
prompt ids and transformers' own processor's pixels; the image's rows
from the sharded encoder = a one-device encoder's to float32 rounding (the all-reduces add the
heads' and the MLP halves' partial sums in another order); the encoder's weights split as vLLM's
``--mm-encoder-tp-mode weights`` splits them (q/k/v and fc1 by output, o and fc2 by input, Qwen's
fused q/k/v cut in three first, its merger column- then row-parallel), the text model's as its
family's; the compiled encoder all-reduces and gathers nothing, and is compiled once, at start-up.
(Qwen3.5's text model at tp=2 on its own: test_gdn_tp.py.)
"""

from __future__ import annotations

import json
import os
import subprocess

import numpy as np
import pytest

from support import tiny_gemma3_vl, tiny_qwen3_5_vl
from support.probes import probe_command, probe_env
from support.tiny_families import family_checkpoints  # noqa: F401  (fixture)
from support.tp_families_probe import PALLAS
from support.vision_tp_probe import PROMPTS, image

from jaxllm.parallel.sharding import TP, vision_rules

NAMES = ("gemma2", "gemma3", "gpt_oss")
VL = ("gemma3", "qwen3_5")


@pytest.fixture(scope="module")
def vl_checkpoints(tmp_path_factory):
    """name -> (transformers' model, the saved checkpoint's folder)."""
    root = tmp_path_factory.mktemp("vision_tp")
    out = {}
    for name, builder, hf in (("gemma3", tiny_gemma3_vl, tiny_gemma3_vl.tiny_model()),
                              ("qwen3_5", tiny_qwen3_5_vl, tiny_qwen3_5_vl.tiny_model(text_layers=2))):
        out[name] = hf, builder.save_vl_checkpoint(hf, str(root / name))
    return out


@pytest.fixture(scope="module")
def probe(family_checkpoints, vl_checkpoints, tmp_path_factory):  # noqa: F811
    root = os.path.dirname(family_checkpoints["gemma3"])
    out = str(tmp_path_factory.mktemp("tp_families") / "probe.npz")
    env = probe_env(XLA_FLAGS="--xla_force_host_platform_device_count=2")
    r = subprocess.run(probe_command("tp_families_probe", root, out, ",".join(NAMES),
                                     ",".join(vl_checkpoints[n][1] for n in VL)),
                       env=env, capture_output=True, text=True, timeout=1500)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    with open(out + ".json") as f:
        meta = json.load(f)
    return dict(np.load(out)), meta


# The Pallas kernel per device runs on the families whose kernel features it adds
# (tp_families_probe.PALLAS: GPT-OSS's split sinks, Gemma 2's soft-cap and window); Gemma 3's
# attention is Gemma 2's to the kernel.
RUNS = [(n, "tp2") for n in NAMES] + [(n, "tp2/pallas") for n in PALLAS]


@pytest.mark.parametrize("name,run", RUNS, ids=[f"{n}-{r}" for n, r in RUNS])
def test_logits_and_greedy_tokens_equal_one_device(probe, name, run):
    arrays, meta = probe
    ref, got = arrays[f"{name}/tp1"], arrays[f"{name}/{run}"]
    rel = np.abs(got - ref).max() / np.abs(ref).max()
    assert rel < 1e-4, f"{name}/{run}: max relative logit error {rel:.2e} against tp=1"
    assert meta[f"{name}/{run}"]["tokens"] == meta[f"{name}/tp1"]["tokens"]


@pytest.mark.parametrize("name", NAMES)
def test_weights_are_split(probe, name, family_checkpoints):  # noqa: F811
    from jaxllm.models.loader import load_model
    arch = load_model(family_checkpoints[name]).arch
    meta = probe[1]
    shards = meta[f"{name}/tp2"]["shards"]
    assert shards["q"][0] == arch.q_size // 2 and shards["o"][1] == arch.q_size // 2, shards
    if name == "gpt_oss":
        assert shards["sinks"] == [arch.num_heads // 2], shards
    assert meta[f"{name}/tp2"]["all_reduce"]


def _reference(name, hf, path, ids, tokens):
    """transformers' greedy choice after each of the engine's tokens: one forward over the prompt
    (``ids``, the engine's) and ``tokens`` with its processor's pixels, the argmax at each position
    from the prompt's last on (equal to ``tokens`` exactly when they are ``generate``'s greedy
    tokens; one forward instead of 32 decoding steps)."""
    import torch
    x = torch.tensor([ids + tokens])
    if name == "gemma3":
        inputs = tiny_gemma3_vl.hf_processor(path)(text=PROMPTS[name], images=[image()], return_tensors="pt")
        assert inputs["input_ids"][0].tolist() == ids, "placeholders expanded unlike Gemma3Processor"
        kw = dict(pixel_values=inputs["pixel_values"], token_type_ids=(x == tiny_gemma3_vl.IMAGE_TOKEN).long())
    else:
        inputs = tiny_qwen3_5_vl.hf_processor()(images=[image()], return_tensors="pt")
        assert ids.count(tiny_qwen3_5_vl.IMAGE_TOKEN) == int(inputs["image_grid_thw"][0].prod()) // 4
        kw = dict(pixel_values=inputs["pixel_values"], image_grid_thw=inputs["image_grid_thw"],
                  mm_token_type_ids=(x == tiny_qwen3_5_vl.IMAGE_TOKEN).int())
    with torch.no_grad():
        logits = hf(input_ids=x, **kw).logits[0]
    return logits[len(ids) - 1:-1].argmax(-1).tolist()


@pytest.mark.parametrize("name", VL)
def test_vl_image_tokens_and_rows_equal_one_device(probe, vl_checkpoints, name):
    arrays, meta = probe
    got = meta[f"vision/{name}"]
    want = _reference(name, *vl_checkpoints[name], got["prompt_token_ids"], got["tokens"])
    assert len(got["tokens"]) == 32 and got["tokens"] == want, f"{name} at tp=2: tokens differ from transformers'"
    assert len(set(want)) > 3, "degenerate greedy run"
    rows, rows1 = arrays[f"vision/{name}/rows"], arrays[f"vision/{name}/rows1"]
    assert rows.shape == rows1.shape == (4, 64)
    err = np.abs(rows - rows1).max() / np.abs(rows1).max()
    assert err < 1e-6, f"{name}: image rows at tp=2 vs one device, max relative error {err:.1e}"


@pytest.mark.parametrize("name", VL)
def test_vl_encoder_weights_split_like_the_text_model(probe, name):
    meta = probe[1][f"vision/{name}"]
    s = meta["shards"]     # one device's shard of layer 0 and of the tower's other weights
    # hidden 32, 2 heads of 16, MLP 64: each device its head's q/k/v columns and o rows, half
    # of fc1's columns and of fc2's rows
    assert s["q"] == s["k"] == s["v"] == [32, 16] and s["q_b"] == [16] and s["o"] == [16, 32]
    assert s["fc1"] == [32, 32] and s["fc1_b"] == [32] and s["fc2"] == [32, 32] and s["fc2_b"] == [32]
    assert s["patch"][1] == s["pos"][1] == 32, "the embeddings stay whole"
    if name == "qwen3_5":
        assert "qkv" not in s, "the fused q/k/v must be cut in three to split by heads"
        assert s["merge_fc1"] == [128, 64] and s["merge_fc2"] == [64, 64]     # merger width 4*32 split
    else:
        assert s["mm_proj"] == [32, 64]
    # the text model's layer 0 (Gemma's attention: 4 heads of 16; Qwen's GDN: q/k/v of 2 key heads)
    weight, rows = {"gemma3": ("q", 64), "qwen3_5": ("in_qkv", 96)}[name]
    assert meta["text_shards"][weight][0] == rows // 2, "the text model splits too"
    # Megatron's layout needs one all-reduce per block and nothing assembled whole; a weight
    # split on the wrong axis would be gathered (or its shapes above would differ)
    assert meta["all_reduce"] and meta["all_gathers"] == []
    # one encoder program (the strict guard fails one compiled after start-up), one image encoded
    assert meta["programs"] == 1 and meta["encoded"] == 1


def test_vision_rules_replicate_what_tp_does_not_divide():
    assert vision_rules({"vision_heads": 16, "vision_mlp": 4304}, 1) == {}
    assert vision_rules({"vision_heads": 16, "vision_mlp": 4304}, 2) == {"vision_heads": TP, "vision_mlp": TP}
    assert vision_rules({"vision_heads": 3, "vision_mlp": 4304, "vision_merge": 6}, 4) == {
        "vision_heads": None, "vision_mlp": TP, "vision_merge": None}
