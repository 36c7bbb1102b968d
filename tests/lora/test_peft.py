"""jaxllm/lora/peft.py: adapters as peft saves them are read with the right scale and shapes;
every adapter this engine cannot take is refused with a ValueError naming ``lora_path`` and
what is wrong.  No engine: the reader against the tiny Llama's parameter table."""

from __future__ import annotations

import math
import os

import numpy as np
import pytest
import transformers
from safetensors.numpy import load_file

from support.lora_adapters import build_set, edit_config

from jaxllm.lora.peft import read_adapter
from jaxllm.lora.targets import lora_targets
from jaxllm.models.llama.params import PARAMS
from jaxllm.models.registry import read_config


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    return build_set(str(tmp_path_factory.mktemp("lora_peft")))


@pytest.fixture(scope="module")
def model(adapters):
    arch = read_config(transformers.AutoConfig.from_pretrained(adapters["base"]), adapters["base"])
    return lora_targets(PARAMS, arch), arch.num_layers


def test_reads_peft_files_with_scale_folded_into_b(adapters, model):
    targets, L = model
    assert sorted(targets) == ["down", "gate", "k", "o", "q", "up", "v"]
    raw = load_file(os.path.join(adapters["b8"], "adapter_model.safetensors"))
    w = read_adapter(adapters["b8"], targets, L, max_rank=8)
    assert w.rank == 8 and sorted(w.weights) == sorted(targets)       # all-linear: every projection
    assert w.scale == pytest.approx(16 / math.sqrt(8))                 # use_rslora: alpha / sqrt(r)
    A, B = w.weights["k"]
    key = "base_model.model.model.layers.1.self_attn.k_proj.lora_{}.weight"
    np.testing.assert_array_equal(A[1], raw[key.format("A")].T)
    np.testing.assert_allclose(B[1], raw[key.format("B")].T * w.scale, rtol=1e-6)
    a4 = read_adapter(adapters["a4"], targets, L, max_rank=8)
    assert a4.scale == pytest.approx(8 / 4) and sorted(a4.weights) == ["down", "o", "q", "v"]


@pytest.mark.parametrize("change, message", [
    (dict(use_dora=True), "use_dora"),
    (dict(modules_to_save=["lm_head"]), "modules_to_save"),
    (dict(r=16), "above max_lora_rank=8"),
    (dict(target_modules=["q_proj", "router_proj"]), "router_proj"),
    (dict(peft_type="PREFIX_TUNING"), "PREFIX_TUNING"),
    (dict(bias="all"), "bias='all'"),
])
def test_bad_adapters_are_refused_by_name(change, message, adapters, model, tmp_path):
    bad = edit_config(adapters["a4"], str(tmp_path / "bad"), **change)
    with pytest.raises(ValueError, match="lora_path=") as e:
        read_adapter(bad, *model, max_rank=8)
    assert message in str(e.value)


def test_missing_files_are_named(adapters, model, tmp_path):
    with pytest.raises(ValueError, match="no such folder"):
        read_adapter(str(tmp_path / "nowhere"), *model, max_rank=8)
    no_weights = edit_config(adapters["a4"], str(tmp_path / "no_weights"))
    os.remove(os.path.join(no_weights, "adapter_model.safetensors"))
    with pytest.raises(ValueError, match="adapter_model.safetensors is missing"):
        read_adapter(no_weights, *model, max_rank=8)
    no_config = edit_config(adapters["a4"], str(tmp_path / "no_config"))
    os.remove(os.path.join(no_config, "adapter_config.json"))
    with pytest.raises(ValueError, match="adapter_config.json is missing"):
        read_adapter(no_config, *model, max_rank=8)
