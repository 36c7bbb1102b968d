"""Hub model ids (jaxllm/hub.py) through huggingface_hub's real code path, against a server on
127.0.0.1 that answers the Hub's HTTP API for tiny checkpoints built here (``HF_ENDPOINT``
points at it): a download to a clean cache, then a start with ``HF_HUB_OFFLINE=1`` and the
server stopped serving the same tokens; a GGUF picked from a repo; the one-line failures
(missing repo, gated repo without a token, unreachable endpoint, offline with nothing cached)."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlsplit

import gguf
import pytest
from support.engines import SMALL_ENGINE
from support.tiny_models import build_tiny, write_gguf

from jaxllm import LLM, SamplingParams, hub
from jaxllm.cli import main
from jaxllm.config import EngineConfig
from jaxllm.models.loader import load_model

ENGINE = {**SMALL_ENGINE, "precompile": "on-demand"}
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
TOKEN = "hf_test_token"


class FakeHub:
    """The Hub's HTTP API as huggingface_hub calls it: ``/api/models/{repo}[/revision/{rev}]``
    (the file list and commit), HEAD/GET ``/{repo}/resolve/{rev}/{file}`` (ETag, X-Repo-Commit,
    Content-Length), a 404 with ``X-Error-Code: RepoNotFound`` and, for a gated repo asked
    without its token, a 401 with ``X-Error-Code: GatedRepo``."""

    def __init__(self, repos: dict[str, dict[str, bytes]], gated: frozenset = frozenset()):
        self.repos, self.gated = repos, gated
        self.sha = {r: hashlib.sha1(json.dumps(sorted(f)).encode()).hexdigest() for r, f in repos.items()}
        self.fetched: list[str] = []   # "repo/file" of every GET of a file
        hub_ = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_HEAD(self):
                hub_.answer(self, body=False)

            def do_GET(self):
                hub_.answer(self, body=True)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def stop(self):
        self.server.shutdown()
        self.server.server_close()

    def answer(self, h: BaseHTTPRequestHandler, body: bool):
        parts = [unquote(p) for p in urlsplit(h.path).path.strip("/").split("/")]
        api = parts[:2] == ["api", "models"]
        if api:
            parts = parts[2:]
        repo, rest = "/".join(parts[:2]), parts[2:]
        if repo not in self.repos:
            return self.error(h, 404, "RepoNotFound")
        if repo in self.gated and h.headers.get("Authorization") != f"Bearer {TOKEN}":
            return self.error(h, 401, "GatedRepo")
        files, sha = self.repos[repo], self.sha[repo]
        if api:
            if rest and (rest[0] != "revision" or rest[1] not in ("main", sha)):
                return self.error(h, 404, "RevisionNotFound")
            data = json.dumps({"id": repo, "modelId": repo, "sha": sha, "private": False, "gated": False,
                               "siblings": [{"rfilename": n, "size": len(b)} for n, b in files.items()]}).encode()
            return self.send(h, 200, data, {"Content-Type": "application/json"}, body)
        if rest[:1] != ["resolve"] or rest[1] not in ("main", sha):
            return self.error(h, 404, "RevisionNotFound")
        name = "/".join(rest[2:])
        if name not in files:
            return self.error(h, 404, "EntryNotFound")
        if body:
            self.fetched.append(f"{repo}/{name}")
        etag = hashlib.sha256(files[name]).hexdigest()
        self.send(h, 200, files[name], {"ETag": f'"{etag}"', "X-Repo-Commit": sha,
                                        "Content-Type": "application/octet-stream"}, body)

    @staticmethod
    def error(h, status: int, code: str):
        FakeHub.send(h, status, json.dumps({"error": code}).encode(),
                     {"X-Error-Code": code, "Content-Type": "application/json"}, True)

    @staticmethod
    def send(h, status: int, data: bytes, headers: dict, body: bool):
        h.send_response(status)
        for k, v in headers.items():
            h.send_header(k, v)
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        if body:
            h.wfile.write(data)


def _read_folder(path: str) -> dict[str, bytes]:
    out = {}
    for name in os.listdir(path):
        with open(os.path.join(path, name), "rb") as f:
            out[name] = f.read()
    return out


@pytest.fixture(scope="module")
def repos(tmp_path_factory, smollm_tokenizer_dir):
    """The repos the fake Hub holds: a tiny Llama checkpoint (with a .bin and an ONNX copy
    that must not be downloaded), the same gated, and two GGUFs of it in one repo."""
    root = tmp_path_factory.mktemp("hub_src")
    hf = build_tiny("llama_gqa_untied", str(root / "hf"), smollm_tokenizer_dir)
    files = _read_folder(hf)
    write_gguf(hf, str(root / "q8.gguf"), matrix_type=gguf.GGMLQuantizationType.Q8_0)
    write_gguf(hf, str(root / "f32.gguf"))
    ggufs = {"tiny-Q8_0.gguf": (root / "q8.gguf").read_bytes(), "tiny-F32.gguf": (root / "f32.gguf").read_bytes(),
             "README.md": b"# tiny\n"}
    return hf, {"tiny/llama": {**files, "pytorch_model.bin": b"unused", "onnx/model.onnx": b"unused"},
                "tiny/gated": dict(files), "tiny/llama-GGUF": ggufs}


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
