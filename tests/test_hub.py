"""Hub model ids (jaxllm/hub.py) through huggingface_hub's real code path, against a server on
127.0.0.1 that answers the Hub's HTTP API for tiny checkpoints built here (``HF_ENDPOINT``
points at it): a download to a clean cache, then a start with ``HF_HUB_OFFLINE=1`` and the
server stopped serving the same tokens; a GGUF picked from a repo; the one-line failures
(missing repo, gated repo without a token, unreachable endpoint, offline with nothing cached).
The same for a Hub id given as ``--tokenizer`` (only its tokenizer files) and as the draft model
of ``--speculative-config``, whose failures name the flag."""

from __future__ import annotations

import json
import logging
import os
import re
import socket

import gguf
import pytest
from support.engines import SMALL_ENGINE
from support.fake_hub import TOKEN, FakeHub, read_folder
from support.tiny_models import build_tiny, write_gguf

from jaxllm import LLM, SamplingParams, hub
from jaxllm.cli import main
from jaxllm.config import EngineConfig
from jaxllm.engine.llm_engine import resolve_hub_ids
from jaxllm.models.loader import load_model

ENGINE = {**SMALL_ENGINE, "precompile": "on-demand"}
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def repos(tmp_path_factory, smollm_tokenizer_dir):
    """The repos the fake Hub holds: a tiny Llama checkpoint (with a .bin and an ONNX copy
    that must not be downloaded), the same gated, and two GGUFs of it in one repo."""
    root = tmp_path_factory.mktemp("hub_src")
    hf = build_tiny("llama_gqa_untied", str(root / "hf"), smollm_tokenizer_dir)
    files = read_folder(hf)
    write_gguf(hf, str(root / "q8.gguf"), matrix_type=gguf.GGMLQuantizationType.Q8_0)
    write_gguf(hf, str(root / "f32.gguf"))
    ggufs = {"tiny-Q8_0.gguf": (root / "q8.gguf").read_bytes(), "tiny-F32.gguf": (root / "f32.gguf").read_bytes(),
             "README.md": b"# tiny\n"}
    tok = {n: b for n, b in files.items() if n.startswith(("tokenizer", "special_tokens", "vocab", "merges"))}
    assert "tokenizer.json" in tok
    return hf, {"tiny/llama": {**files, "pytorch_model.bin": b"unused", "onnx/model.onnx": b"unused"},
                "tiny/gated": dict(files), "tiny/llama-GGUF": ggufs,
                # a tokenizer repo with weights beside it that --tokenizer must not download
                "tiny/tok": {**tok, "model.safetensors": b"unused", "README.md": b"# tok\n"}}


@pytest.fixture
def fake_hub(repos, monkeypatch):
    server = FakeHub(repos[1], gated=frozenset({"tiny/gated"}))
    monkeypatch.setenv("HF_ENDPOINT", server.url)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", False)
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_DISABLE_IMPLICIT_TOKEN", True)
    yield server
    server.stop()


def _go_offline(monkeypatch):
    # huggingface_hub reads HF_HUB_OFFLINE at import; a user sets it before starting.
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)


def _tokens(llm) -> list[int]:
    out = llm.generate(["Hello world"], GREEDY, use_tqdm=False)[0]
    return out.prompt_token_ids + out.outputs[0].token_ids


def test_download_to_a_clean_cache_then_offline_serves_the_same_tokens(fake_hub, tmp_path, monkeypatch, caplog):
    cache = str(tmp_path / "hf_cache")
    with caplog.at_level(logging.INFO, logger="jaxllm.hub"):
        llm = LLM("tiny/llama", download_dir=cache, **ENGINE)
    # not a terminal: one line per file instead of huggingface_hub's bars
    lines = [r.getMessage() for r in caplog.records if r.name == "jaxllm.hub"]
    assert lines[0].startswith(f"downloading tiny/llama from {fake_hub.url}: ")
    assert lines[-2].startswith("downloaded tiny/llama in ") and lines[-1].startswith(f"Hub model tiny/llama: {cache}")
    assert any(re.fullmatch(r"downloading model\.safetensors \(\d+\.\d (KiB|MiB)\)", line) for line in lines), lines
    assert llm.llm_engine.model_name == "tiny/llama"
    online = _tokens(llm)
    del llm
    # only what the engine reads: no .bin, no ONNX copy
    wanted = set(fake_hub.repos["tiny/llama"]) - {"pytorch_model.bin", "onnx/model.onnx"}
    assert "model.safetensors" in wanted and "tokenizer.json" in wanted
    assert {f.split("/", 2)[2] for f in fake_hub.fetched} == wanted
    fake_hub.stop()
    _go_offline(monkeypatch)
    llm = LLM("tiny/llama", download_dir=cache, **ENGINE)
    assert llm.llm_engine.model_name == "tiny/llama"
    assert _tokens(llm) == online


def test_unreachable_hub_falls_back_to_the_cache(fake_hub, tmp_path, monkeypatch):
    cache = str(tmp_path / "hf_cache")
    folder = hub.resolve("tiny/llama", download_dir=cache)
    fake_hub.stop()
    assert hub.resolve("tiny/llama", revision="main", download_dir=cache) == folder


def test_gguf_picked_from_a_repo_by_tag_or_name(fake_hub, tmp_path, monkeypatch):
    cache = str(tmp_path / "hf_cache")
    path = hub.resolve("tiny/llama-GGUF:q8_0", download_dir=cache)
    assert os.path.basename(path) == "tiny-Q8_0.gguf"
    assert fake_hub.fetched == ["tiny/llama-GGUF/tiny-Q8_0.gguf"]   # the one file, not the repo
    assert "Q8_0" in load_model(path).formats()   # served as its packed blocks
    named = hub.resolve("tiny/llama-GGUF", download_dir=cache, gguf_file="tiny-F32.gguf")
    assert os.path.basename(named) == "tiny-F32.gguf"
    with pytest.raises(hub.HubError, match=r"holds 2 GGUF files: pick one with tiny/llama-GGUF:QUANT or --gguf-file"):
        hub.resolve("tiny/llama-GGUF", download_dir=cache)
    with pytest.raises(hub.HubError, match=r"has no GGUF file tagged Q4_K_M \(its GGUF files: tiny-F32.gguf, tiny-Q8"):
        hub.resolve("tiny/llama-GGUF:Q4_K_M", download_dir=cache)
    _go_offline(monkeypatch)   # the pick from the cached snapshot
    assert hub.resolve("tiny/llama-GGUF:Q8_0", download_dir=cache) == path


def test_gated_repo_downloads_with_hf_token(fake_hub, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    folder = hub.resolve("tiny/gated", download_dir=str(tmp_path / "c"))
    assert os.path.isfile(os.path.join(folder, "config.json"))


def _cli_error(capsys, *argv) -> str:
    rc = main(["generate", "x", *argv])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "Traceback" not in err[0], err
    return err[0]


def test_failures_are_one_line_naming_the_cause(fake_hub, tmp_path, capsys, monkeypatch):
    cache = ["--download-dir", str(tmp_path / "c")]
    err = _cli_error(capsys, "--model", "tiny/missing", *cache)
    assert "no Hub repo tiny/missing exists on " + fake_hub.url in err and "HTTP 404" in err
    err = _cli_error(capsys, "--model", "tiny/gated", *cache)
    assert "tiny/gated is a gated repo" in err and "HTTP 401" in err and "set HF_TOKEN" in err
    with socket.socket() as s:   # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    monkeypatch.setenv("HF_ENDPOINT", dead)
    err = _cli_error(capsys, "--model", "tiny/llama", *cache)
    assert f"cannot reach the Hub at {dead} to get tiny/llama" in err and "check the network or HF_ENDPOINT" in err
    _go_offline(monkeypatch)
    err = _cli_error(capsys, "--model", "tiny/llama", *cache)
    assert "HF_HUB_OFFLINE is set and the cache" in err and "lacks tiny/llama" in err


def test_hub_flags_checked_before_anything_loads():
    with pytest.raises(ValueError, match="--gguf-file model.bin: expected the name of a .gguf file"):
        EngineConfig(model="org/repo", gguf_file="model.bin")
    with pytest.raises(ValueError, match="picks a GGUF by its tag and --gguf-file"):
        EngineConfig(model="org/repo:Q4_K_M", gguf_file="a.gguf")
    with pytest.raises(ValueError, match=r"--revision v2 picks a version of a Hub repo; the model \(the built-in"):
        EngineConfig(revision="v2")
    assert hub.is_hub_id("Qwen/Qwen3-0.6B") and hub.is_hub_id("org/repo:Q4_K_M") and hub.is_hub_id("gpt2")
    assert not any(hub.is_hub_id(m) for m in ("./x", "/a/b", "a/b/c", "m.gguf", "a/../b", None))


def test_tokenizer_hub_id_downloads_its_files_only_then_offline_serves_the_same_tokens(
        fake_hub, repos, tmp_path, monkeypatch):
    cache = str(tmp_path / "hf_cache")
    llm = LLM(repos[0], tokenizer="tiny/tok", download_dir=cache, **ENGINE)
    online = _tokens(llm)
    del llm
    wanted = {n for n in fake_hub.repos["tiny/tok"] if n.startswith("tokenizer") or n.startswith("special")}
    assert "tokenizer.json" in wanted
    assert {f.split("/", 2)[2] for f in fake_hub.fetched} == wanted   # no weights, no README
    fake_hub.stop()
    _go_offline(monkeypatch)
    llm = LLM(repos[0], tokenizer="tiny/tok", download_dir=cache, **ENGINE)
    assert _tokens(llm) == online


def test_tokenizer_revision_follows_vllm(fake_hub, repos, tmp_path):
    cache = str(tmp_path / "c")
    sha = fake_hub.sha["tiny/tok"]
    config = resolve_hub_ids(EngineConfig(model=repos[0], tokenizer="tiny/tok", tokenizer_revision=sha,
                                           download_dir=cache))
    assert os.path.isfile(os.path.join(config.tokenizer, "tokenizer.json")) and config.tokenizer_revision is None
    assert config.model == repos[0]
    # --tokenizer-revision alone: the model repo's tokenizer at that revision (not its weights')
    with pytest.raises(hub.HubError, match=r"^--tokenizer tiny/llama: tiny/llama has no revision 'v9'"):
        resolve_hub_ids(EngineConfig(model="tiny/llama", tokenizer_revision="v9", download_dir=cache))
    # no --tokenizer-revision: --revision (here the model repo's commit, which tiny/tok lacks), as vLLM
    llama_sha = fake_hub.sha["tiny/llama"]
    with pytest.raises(hub.HubError, match=rf"^--tokenizer tiny/tok: tiny/tok has no revision '{llama_sha}'"):
        resolve_hub_ids(EngineConfig(model="tiny/llama", revision=llama_sha, tokenizer="tiny/tok", download_dir=cache))
    with pytest.raises(ValueError, match=r"--tokenizer-revision v1 picks a version of a Hub repo; the tokenizer "
                                         r"\(the built-in model\) is not a Hub id"):
        EngineConfig(tokenizer_revision="v1")
    with pytest.raises(ValueError, match=r"--speculative-config: revision must be a non-empty string"):
        EngineConfig(speculative_config={"model": "tiny/llama", "revision": "", "num_speculative_tokens": 2})


def test_draft_model_hub_id_downloads_then_offline_serves_the_same_tokens(fake_hub, repos, tmp_path, monkeypatch):
    cache = str(tmp_path / "hf_cache")
    # The same checkpoint and speculation settings as the draft engines of
    # tests/spec_decode/test_spec_identity_draft.py and test_draft_kv.py (SMALL_ENGINE, k = 3, always
    # drafting): the same programs, which the run's compile cache holds once for all of them.
    spec = {"model": "tiny/llama", "revision": "main", "num_speculative_tokens": 3, "min_acceptance_rate": 0.0,
            "cost_model": False}
    llm = LLM(repos[0], speculative_config=spec, download_dir=cache, **ENGINE)
    online = _tokens(llm)
    del llm
    assert "tiny/llama/model.safetensors" in fake_hub.fetched
    fake_hub.stop()
    _go_offline(monkeypatch)
    llm = LLM(repos[0], speculative_config=spec, download_dir=cache, **ENGINE)
    assert _tokens(llm) == online
    # The draft ran: it is the target's own checkpoint, so greedy proposals are accepted.
    assert llm.llm_engine.core.scheduler.spec_stats.num_accepted_tokens > 0


@pytest.mark.parametrize("flag", ["--tokenizer", "--speculative-config model"])
def test_tokenizer_and_draft_failures_are_one_line_naming_the_flag(flag, fake_hub, tmp_path, capsys, monkeypatch):
    def args(repo):
        if flag == "--tokenizer":
            return ["--tokenizer", repo, "--download-dir", str(tmp_path / "c")]
        return ["--speculative-config", json.dumps({"model": repo, "num_speculative_tokens": 2}),
                "--download-dir", str(tmp_path / "c")]

    err = _cli_error(capsys, *args("tiny/missing"))
    assert f"{flag} 'tiny/missing' is not a local path and no Hub repo tiny/missing " \
        f"exists on {fake_hub.url} (HTTP 404)" in err, err
    err = _cli_error(capsys, *args("tiny/gated"))
    assert f"{flag} tiny/gated: tiny/gated is a gated repo" in err and "set HF_TOKEN" in err, err
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    monkeypatch.setenv("HF_ENDPOINT", dead)
    err = _cli_error(capsys, *args("tiny/tok"))
    assert f"{flag} tiny/tok: cannot reach the Hub at {dead} to get tiny/tok" in err, err
    _go_offline(monkeypatch)
    err = _cli_error(capsys, *args("tiny/tok"))
    assert f"{flag} tiny/tok: HF_HUB_OFFLINE is set and the cache" in err, err
