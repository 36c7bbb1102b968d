"""jaxllm/multimodal/media.py: data URLs, http(s) with a timeout and a byte cap, file:// only
under the allowed folder (no '..' or symlink escape), the formats and the bomb guard."""

from __future__ import annotations

import io
import os
import pathlib

import numpy as np
import pytest
from PIL import Image

from jaxllm.multimodal.media import MediaLimits, load_image
from support.images import ByteServer, data_url, encode, pattern

LIMITS = MediaLimits()


@pytest.mark.parametrize("fmt,mime,lossless", [("PNG", "image/png", True), ("JPEG", "image/jpeg", False),
                                               ("WEBP", "image/webp", True)])
def test_data_urls_decode_each_format(fmt, mime, lossless):
    src = pattern(9, 7, seed=1)
    kw = {"lossless": True} if fmt == "WEBP" else ({"quality": 95} if fmt == "JPEG" else {})
    data = encode(src, fmt, **kw)
    img = load_image(data_url(data, mime), limits=LIMITS)
    assert img.mode == "RGB" and img.size == (9, 7)
    # JPEG is lossy: the oracle is Pillow's own decode of the same bytes.
    want = src if lossless else Image.open(io.BytesIO(data)).convert("RGB")
    assert (np.asarray(img) == np.asarray(want)).all()


def test_transparency_is_composited_over_white():
    rgba = Image.new("RGBA", (2, 2), (10, 20, 30, 0))
    img = load_image(data_url(encode(rgba, "PNG")), limits=LIMITS)
    assert img.mode == "RGB" and img.getpixel((0, 0)) == (255, 255, 255)


@pytest.mark.parametrize("url,needle", [
    ("data:image/png;base64,%%%notbase64", "not valid base64"),
    ("data:image/gif;base64,R0lGOD", "media type 'image/gif' is not supported"),
    ("data:image/png,rawbytes", "must be base64"),
    ("data:image/png;base64", "no ','"),
    ("ftp://example.com/a.png", "scheme 'ftp' is not supported"),
    ("just-a-name.png", "scheme '(none)'"),
    ("", "empty"),
])
def test_malformed_urls_name_what_failed(url, needle):
    with pytest.raises(ValueError, match=None) as e:
        load_image(url, limits=LIMITS)
    assert needle in str(e.value)


def test_unsupported_format_and_corrupt_bytes():
    gif = encode(pattern(), "GIF")
    with pytest.raises(ValueError, match="cannot decode the bytes as PNG/JPEG/WEBP"):
        load_image(data_url(gif, "image/png"), limits=LIMITS)  # the bytes decide, not the label
    truncated = encode(pattern(64, 64), "PNG")[:200]
    with pytest.raises(ValueError, match="corrupt"):
        load_image(data_url(truncated), limits=LIMITS)


def test_decompression_bomb_is_refused_before_decoding():
    big = encode(Image.new("L", (400, 300)), "PNG")  # 120,000 pixels in a few hundred bytes
    assert len(big) < 2000
    with pytest.raises(ValueError, match="400x300 = 120000 pixels is over the limit of 100000"):
        load_image(data_url(big), limits=MediaLimits(max_pixels=100_000))
    assert load_image(data_url(big), limits=MediaLimits(max_pixels=120_000)).size == (400, 300)


def test_data_url_size_cap():
    png = encode(pattern(32, 32), "PNG")
    assert load_image(data_url(png), limits=MediaLimits(max_bytes=len(png))).size == (32, 32)
    with pytest.raises(ValueError, match=f"over the size limit of {len(png) - 1} bytes"):
        load_image(data_url(png), limits=MediaLimits(max_bytes=len(png) - 1))


def test_http_fetch_cap_timeout_and_errors():
    png = encode(pattern(40, 40, seed=3), "PNG")
    big = encode(pattern(200, 200, seed=4), "PNG")  # ~120 KB of noise
    routes = {"/ok.png": (200, png, {"Content-Length": str(len(png))}, 0.0),
              # no Content-Length: only the streaming cap can stop it
              "/big.png": (200, big, {}, 0.0),
              "/slow.png": (200, png, {}, 0.3),
              "/gone.png": (404, b"", {}, 0.0)}
    with ByteServer(routes) as srv:
        img = load_image(srv.url("/ok.png"), limits=LIMITS)
        assert (np.asarray(img) == np.asarray(pattern(40, 40, seed=3))).all()
        cap = MediaLimits(max_bytes=50_000)
        assert len(big) > cap.max_bytes
        with pytest.raises(ValueError, match="body is over the size limit of 50000 bytes"):
            load_image(srv.url("/big.png"), limits=cap)
        assert load_image(srv.url("/big.png"), limits=MediaLimits(max_bytes=len(big))).size == (200, 200)
        with pytest.raises(ValueError, match="Content-Length .* over the size limit"):
            load_image(srv.url("/ok.png"), limits=MediaLimits(max_bytes=len(png) - 1))
        # drips a 1 KiB write every 0.3 s: each read is quick, the whole fetch is not
        with pytest.raises(ValueError, match="timed out after 0.5 s"):
            load_image(srv.url("/slow.png"), limits=MediaLimits(timeout_s=0.5))
        with pytest.raises(ValueError, match="answered HTTP 404"):
            load_image(srv.url("/gone.png"), limits=LIMITS)
    with pytest.raises(ValueError, match="cannot fetch"):
        load_image(srv.url("/ok.png"), limits=LIMITS)  # server closed: connection refused


def test_file_urls_only_inside_the_allowed_folder(tmp_path: pathlib.Path):
    allowed, outside = tmp_path / "media", tmp_path / "private"
    allowed.mkdir(), outside.mkdir()
    (allowed / "sub").mkdir()
    png = encode(pattern(5, 4, seed=2), "PNG")
    (allowed / "sub" / "in.png").write_bytes(png)
    (outside / "secret.png").write_bytes(png)
    os.symlink(outside / "secret.png", allowed / "link.png")      # a link pointing out
    os.symlink(outside, allowed / "dirlink")                       # a folder link pointing out
    limits = MediaLimits(allowed_local_media_path=str(allowed))

    assert load_image(f"file://{allowed}/sub/in.png", limits=limits).size == (5, 4)
    for url in (f"file://{outside}/secret.png", f"file://{allowed}/../private/secret.png",
                f"file://{allowed}/link.png", f"file://{allowed}/dirlink/secret.png",
                f"file://{allowed}-evil/x.png"):
        with pytest.raises(ValueError, match="outside --allowed-local-media-path"):
            load_image(url, limits=limits)
    with pytest.raises(ValueError, match="not started with --allowed-local-media-path"):
        load_image(f"file://{allowed}/sub/in.png", limits=LIMITS)
    with pytest.raises(ValueError, match="cannot read"):
        load_image(f"file://{allowed}/missing.png", limits=limits)
    with pytest.raises(ValueError, match="over the size limit"):
        load_image(f"file://{allowed}/sub/in.png",
                   limits=MediaLimits(allowed_local_media_path=str(allowed), max_bytes=len(png) - 1))
    with pytest.raises(ValueError, match="not an existing directory"):
        MediaLimits(allowed_local_media_path=str(tmp_path / "nope"))
