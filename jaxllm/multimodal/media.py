"""One image URL -> one decoded RGB ``PIL.Image``, within limits (vLLM's MediaConnector, cut down).

A request may point at an image three ways, as vLLM accepts them:

* ``data:image/<png|jpeg|webp>;base64,...`` -- inline bytes;
* ``http://`` / ``https://`` -- fetched with the standard library, a timeout on the whole
  fetch (vLLM's ``VLLM_IMAGE_FETCH_TIMEOUT``, 5 s) and a byte cap read as the body streams, so
  a huge or endless body costs at most ``max_bytes`` of memory;
* ``file://`` -- only under ``--allowed-local-media-path`` (vLLM's flag), and only when the
  *resolved* path (symlinks followed, ``..`` collapsed) stays inside that folder.

Anything else is refused.  Decoding accepts PNG, JPEG and WebP only, and checks the pixel
count from the header *before* decoding (a decompression bomb is a few KB of PNG that
decodes to gigabytes).  Every failure is a ``ValueError`` whose message names what failed;
the server turns it into a 400 naming the content part.
"""

from __future__ import annotations

import base64
import binascii
import io
import os
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass

from PIL import Image, UnidentifiedImageError

FORMATS = ("PNG", "JPEG", "WEBP")
"""Pillow's names of the formats an image may arrive in (the issue's list; OpenAI's minus GIF)."""
_MIME_FORMAT = {"image/png": "PNG", "image/jpeg": "JPEG", "image/jpg": "JPEG", "image/webp": "WEBP"}
_CHUNK = 64 * 1024


@dataclass(frozen=True)
class MediaLimits:
    """Where images may come from and how big they may be."""

    allowed_local_media_path: str | None = None
    """The folder ``file://`` URLs may read from (``--allowed-local-media-path``, vLLM's flag);
    None refuses every ``file://`` URL, as vLLM does by default."""
    timeout_s: float = 5.0
    """Seconds an ``http(s)`` fetch may take in all (vLLM's ``VLLM_IMAGE_FETCH_TIMEOUT``, 5)."""
    max_bytes: int = 20 * 1024 * 1024
    """The most encoded bytes one image may have, from any source (20 MiB: OpenAI's per-image cap)."""
    max_pixels: int = Image.MAX_IMAGE_PIXELS or 89_478_485
    """The most pixels (width x height) one image may decode to: Pillow's own bomb threshold."""

    def __post_init__(self):
        if not self.timeout_s > 0:
            raise ValueError(f"MediaLimits.timeout_s must be > 0 seconds, got {self.timeout_s!r}")
        if not (isinstance(self.max_bytes, int) and self.max_bytes > 0):
            raise ValueError(f"MediaLimits.max_bytes must be a positive integer, got {self.max_bytes!r}")
        if not (isinstance(self.max_pixels, int) and self.max_pixels > 0):
            raise ValueError(f"MediaLimits.max_pixels must be a positive integer, got {self.max_pixels!r}")
        path = self.allowed_local_media_path
        if path is not None and not os.path.isdir(path):
            raise ValueError(f"--allowed-local-media-path: {path!r} is not an existing directory")


def load_image(url: str, *, limits: MediaLimits) -> Image.Image:
    """The image ``url`` points at, decoded to RGB; a ValueError naming what failed."""
    if not isinstance(url, str) or not url:
        raise ValueError("image url is empty")
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme == "data":
        data = _data_url_bytes(url, limits)
    elif scheme in ("http", "https"):
        data = _http_bytes(url, limits)
    elif scheme == "file":
        data = _file_bytes(url, limits)
    else:
        raise ValueError(f"image url scheme {scheme or '(none)'!r} is not supported: send a data: URL "
                         "(base64 PNG/JPEG/WebP), an http(s):// URL, or file:// under --allowed-local-media-path")
    return decode_image(data, limits)


def decode_image(data: bytes, limits: MediaLimits) -> Image.Image:
    """Encoded bytes -> RGB image, PNG/JPEG/WebP only, the pixel count checked before decoding."""
    try:
        img = Image.open(io.BytesIO(data), formats=FORMATS)  # reads the header only
    except UnidentifiedImageError:
        raise ValueError(f"image: cannot decode the bytes as {'/'.join(FORMATS)} (unsupported format or "
                         "corrupt data)") from None
    except Image.DecompressionBombError as e:
        raise ValueError(f"image: {e}") from None
    w, h = img.size
    if w * h > limits.max_pixels:
        raise ValueError(f"image: {w}x{h} = {w * h} pixels is over the limit of {limits.max_pixels} "
                         "(a decompression bomb?)")
    try:
        img.load()
    except (OSError, SyntaxError, Image.DecompressionBombError) as e:
        raise ValueError(f"image: the {img.format} data is corrupt ({e})") from None
    return _to_rgb(img)


def _to_rgb(img: Image.Image) -> Image.Image:
    # vLLM's ImageMediaIO: transparency is composited over white, then RGB.
    if img.mode in ("RGBA", "LA") or (img.mode == "P" and "transparency" in img.info):
        rgba = img.convert("RGBA")
        bg = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(bg, rgba).convert("RGB")
    return img.convert("RGB") if img.mode != "RGB" else img


def _data_url_bytes(url: str, limits: MediaLimits) -> bytes:
    head, sep, payload = url[len("data:"):].partition(",")
    if not sep:
        raise ValueError("image data URL has no ',' before its data (expected data:image/png;base64,...)")
    parts = [p.strip().lower() for p in head.split(";")]
    mime, is_b64 = parts[0], "base64" in parts[1:]
    if mime not in _MIME_FORMAT:
        raise ValueError(f"image data URL media type {mime or '(none)'!r} is not supported "
                         f"(image/png, image/jpeg or image/webp)")
    if not is_b64:
        raise ValueError("image data URL must be base64-encoded (data:<type>;base64,...)")
    # 4 base64 characters hold 3 bytes: refuse before decoding what would be over the cap.
    if len(payload) // 4 * 3 > limits.max_bytes + 3:
        raise ValueError(f"image data URL is over the size limit of {limits.max_bytes} bytes")
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError("image data URL is not valid base64") from None
    if len(data) > limits.max_bytes:
        raise ValueError(f"image data URL is over the size limit of {limits.max_bytes} bytes")
    return data


def _http_bytes(url: str, limits: MediaLimits) -> bytes:
    deadline = time.monotonic() + limits.timeout_s
    req = urllib.request.Request(url, headers={"User-Agent": "jaxllm"})
    try:
        with urllib.request.urlopen(req, timeout=limits.timeout_s) as resp:
            length = resp.headers.get("Content-Length")
            if length is not None and length.isdigit() and int(length) > limits.max_bytes:
                raise ValueError(f"image url {url!r}: Content-Length {length} is over the size limit of "
                                 f"{limits.max_bytes} bytes")
            buf = bytearray()
            while True:
                # The socket timeout bounds each read; the deadline bounds the whole body (a
                # server dripping one byte a second would otherwise never time out).
                if time.monotonic() > deadline:
                    raise ValueError(f"image url {url!r}: fetch timed out after {limits.timeout_s:g} s")
                chunk = resp.read(_CHUNK)
                if not chunk:
                    return bytes(buf)
                buf += chunk
                if len(buf) > limits.max_bytes:
                    raise ValueError(f"image url {url!r}: the body is over the size limit of "
                                     f"{limits.max_bytes} bytes")
    except urllib.error.HTTPError as e:
        raise ValueError(f"image url {url!r}: the server answered HTTP {e.code}") from None
    except TimeoutError:
        raise ValueError(f"image url {url!r}: fetch timed out after {limits.timeout_s:g} s") from None
    except (urllib.error.URLError, OSError) as e:
        reason = getattr(e, "reason", e)
        if isinstance(reason, TimeoutError):
            raise ValueError(f"image url {url!r}: fetch timed out after {limits.timeout_s:g} s") from None
        raise ValueError(f"image url {url!r}: cannot fetch ({reason})") from None


def _file_bytes(url: str, limits: MediaLimits) -> bytes:
    if limits.allowed_local_media_path is None:
        raise ValueError("image file:// URLs are refused: the server was not started with "
                         "--allowed-local-media-path")
    parsed = urllib.parse.urlparse(url)
    if parsed.netloc not in ("", "localhost"):
        raise ValueError(f"image file URL {url!r} names a host; only file:///absolute/path is supported")
    path = urllib.parse.unquote(parsed.path)
    # Both sides resolved: symlinks followed and '..' collapsed, so neither a link pointing out
    # nor a '../' walk can leave the allowed folder.
    root = os.path.realpath(limits.allowed_local_media_path)
    real = os.path.realpath(path)
    if os.path.commonpath([root, real]) != root:
        raise ValueError(f"image file URL {url!r} is outside --allowed-local-media-path ({root})")
    try:
        with open(real, "rb") as f:
            data = f.read(limits.max_bytes + 1)
    except OSError as e:
        raise ValueError(f"image file URL {url!r}: cannot read ({e.strerror or e})") from None
    if len(data) > limits.max_bytes:
        raise ValueError(f"image file URL {url!r} is over the size limit of {limits.max_bytes} bytes")
    return data
