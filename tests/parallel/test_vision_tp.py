"""A vision-language model at tp=2 (two simulated CPU devices) serves an image token-exact.

The engine runs in a subprocess (support/vision_tp_probe.py: the device count is fixed before
JAX starts), one per module, both families in it: Gemma 3 (SigLIP tower + projector) and
Qwen3.5 (2D-rotary ViT + patch merger; its text model cut to 2 layers, one GDN and one full
attention, to compile less).  ``LLM(tensor_parallel_size=2)`` on the XLA path under the strict
compile guard, one image, 32 greedy tokens = transformers' ``generate`` (float32) on the
engine's prompt ids and transformers' own processor's pixels; the image's rows from the
sharded encoder = a one-device encoder's to float32 rounding (the all-reduces add the heads'
and the MLP halves' partial sums in another order); the encoder's weights split as vLLM's
``--mm-encoder-tp-mode weights`` splits them (q/k/v and fc1 by output, o and fc2 by input,
Qwen's fused q/k/v cut in three first, its merger column- then row-parallel), the text model's
as its family's, the compiled encoder all-reducing and gathering nothing, compiled once (at
start-up).  The text families' own tp=2 cells: test_tp_families.py (Gemma 3), test_gdn_tp.py
(Qwen3.5).
"""

from __future__ import annotations

import numpy as np
import pytest
from support import tiny_gemma3_vl, tiny_qwen3_5_vl
from support.tp_probe import run_probe
from support.vision_tp_probe import PROMPTS, image

from jaxllm.parallel.sharding import TP, vision_rules

NAMES = ("gemma3", "qwen3_5")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("vision_tp")
    hf = {"gemma3": tiny_gemma3_vl.tiny_model(), "qwen3_5": tiny_qwen3_5_vl.tiny_model(text_layers=2)}
    builders = {"gemma3": tiny_gemma3_vl, "qwen3_5": tiny_qwen3_5_vl}
    paths = {n: builders[n].save_vl_checkpoint(hf[n], str(root / n)) for n in NAMES}
    return root, hf, paths


@pytest.fixture(scope="module")
def probe(checkpoints):
    root, _, paths = checkpoints
    return run_probe("vision_tp_probe", root, [paths[n] for n in NAMES])


def _reference(name, hf, path, prompt_ids):
    """transformers' 32 greedy tokens on the engine's prompt ids with its processor's pixels."""
    if name == "gemma3":
        inputs = tiny_gemma3_vl.hf_processor(path)(text=PROMPTS[name], images=[image()], return_tensors="np")
        assert inputs["input_ids"][0].tolist() == prompt_ids, "placeholders expanded unlike Gemma3Processor"
        return tiny_gemma3_vl.hf_greedy_vl(hf, prompt_ids, inputs["pixel_values"])[1]
    inputs = tiny_qwen3_5_vl.hf_processor()(images=[image()], return_tensors="np")
    grids = inputs["image_grid_thw"].tolist()
    assert prompt_ids.count(tiny_qwen3_5_vl.IMAGE_TOKEN) == np.prod(grids[0]) // 4
    return tiny_qwen3_5_vl.hf_greedy_vl(hf, prompt_ids, inputs["pixel_values"], grids)[1]


@pytest.mark.parametrize("name", NAMES)
def test_tp2_image_tokens_and_rows_equal_one_device(probe, checkpoints, name):
    arrays, meta = probe
    _, hf, paths = checkpoints
    got = meta[name]
    want = _reference(name, hf[name], paths[name], got["prompt_token_ids"])
    assert got["tokens"] == want, f"{name} at tp=2: tokens differ from transformers'"
    assert len(set(want)) > 3, "degenerate greedy run"
    rows, rows1 = arrays[f"{name}/rows"], arrays[f"{name}/rows1"]
    assert rows.shape == rows1.shape == (4, 64)
    err = np.abs(rows - rows1).max() / np.abs(rows1).max()
    assert err < 1e-5, f"{name}: image rows at tp=2 vs one device, max relative error {err:.1e}"


@pytest.mark.parametrize("name", NAMES)
def test_encoder_weights_split_like_the_text_model(probe, name):
    meta = probe[1][name]
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
    assert meta["programs"] == 1 and meta["encoded"] == 1, "the encoder: one program, compiled at start-up"


def test_vision_rules_replicate_what_tp_does_not_divide():
    assert vision_rules({"vision_heads": 16, "vision_mlp": 4304}, 1) == {}
    assert vision_rules({"vision_heads": 16, "vision_mlp": 4304}, 2) == {"vision_heads": TP, "vision_mlp": TP}
    assert vision_rules({"vision_heads": 3, "vision_mlp": 4304, "vision_merge": 6}, 4) == {
        "vision_heads": None, "vision_mlp": TP, "vision_merge": None}
