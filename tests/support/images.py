"""Small test images as encoded bytes and data URLs, and a local HTTP server that serves bytes
(tests/multimodal/test_media.py, tests/serve/test_image_parts.py)."""

from __future__ import annotations

import base64
import io
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
from PIL import Image


def pattern(w: int = 8, h: int = 6, seed: int = 0) -> Image.Image:
    """An RGB image of random pixels (distinct per seed)."""
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8), "RGB")


def encode(img: Image.Image, fmt: str, **kw) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format=fmt, **kw)
    return buf.getvalue()


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


class ByteServer:
    """A threaded HTTP server on 127.0.0.1: ``routes`` maps a path to (status, body, headers,
    seconds to sleep between 1 KiB writes).  A context manager; ``url(path)`` addresses it."""

    def __init__(self, routes: dict):
        self.routes = routes
        routes_ = routes

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                status, body, headers, drip = routes_.get(self.path, (404, b"no", {}, 0.0))
                self.send_response(status)
                for k, v in headers.items():
                    self.send_header(k, v)
                self.end_headers()
                try:
                    for i in range(0, len(body), 1024):
                        self.wfile.write(body[i:i + 1024])
                        self.wfile.flush()
                        if drip:
                            time.sleep(drip)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client gave up (cap or timeout): expected

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}{path}"

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()


class ImageEngine:
    """``engine`` (a text model's) saying ``supports_images``: the server's image path runs up to
    the engine call, where the input processor records each prompt (``multi_modal_data`` and
    all) and hands the real one the prompt without it.  Stands in for a vision-language engine
    until the model side of issue 41 lands; everything else is ``engine``'s."""

    supports_images = True

    def __init__(self, engine):
        self._engine = engine
        self.prompts: list[dict] = []
        self.input_processor = _RecordingProcessor(engine.input_processor, self.prompts)

    def __getattr__(self, name):
        return getattr(self._engine, name)


class _RecordingProcessor:
    def __init__(self, inner, prompts: list):
        self._inner, self._prompts = inner, prompts

    def process_inputs(self, request_id, prompt, params, **kw):
        self._prompts.append(prompt)
        text_only = {k: v for k, v in prompt.items() if k != "multi_modal_data"}
        return self._inner.process_inputs(request_id, text_only, params, **kw)

    def __getattr__(self, name):
        return getattr(self._inner, name)
