"""A server on 127.0.0.1 that answers the Hugging Face Hub's HTTP API for repos held in memory
(point ``HF_ENDPOINT`` at its ``url``), so that jaxllm/hub.py runs huggingface_hub's real code
path without a network: tests/test_hub.py, tests/docs (the README's Hub model ids)."""

from __future__ import annotations

import hashlib
import json
import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlsplit

TOKEN = "hf_test_token"
"""The token a gated repo wants (``Authorization: Bearer``)."""


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


def read_folder(path: str) -> dict[str, bytes]:
    out = {}
    for name in os.listdir(path):
        with open(os.path.join(path, name), "rb") as f:
            out[name] = f.read()
    return out
