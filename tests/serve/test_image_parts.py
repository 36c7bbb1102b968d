"""Image content parts over HTTP (serve/images.py, serve/protocol.py, serve/responses/convert.py):
each bad input a 400 in OpenAI's shape naming the part, the server then serving a normal
request; the decoded images reach the engine prompt as vLLM's ``multi_modal_data``, in order.

The shared server's tiny model is text-only (its engine has no ``supports_images``); the image
server runs the same engine under ``support.images.ImageEngine``, which says it takes images
and records what the input processor receives (no vision model exists here yet).  No new
engine is built and nothing compiles beyond the shared engine's programs.
"""

from __future__ import annotations

import json

import httpx
import numpy as np
import pytest

pytest.register_assert_rewrite("support.serve_helpers")

from support.images import ByteServer, ImageEngine, data_url, encode, pattern  # noqa: E402
from support.serve_helpers import ServerThread, assert_error_shape  # noqa: E402

from jaxllm import cli  # noqa: E402
from jaxllm.config import ServingConfig  # noqa: E402
from serve.cli import serving_config_from_args  # noqa: E402

pytest_plugins = ["support.serve_helpers"]

CHAT = "/v1/chat/completions"
# A vision-language template's shape: parts in order, each image part a placeholder.
TEMPLATE = ("{% for m in messages %}<|{{ m.role }}|>{% if m.content is string %}{{ m.content }}{% else %}"
            "{% for p in m.content %}{% if p.type == 'image' %}<image>{% else %}{{ p.text }}{% endif %}{% endfor %}"
            "{% endif %}\n{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
PNG = [encode(pattern(6, 5, seed=s), "PNG") for s in range(3)]


def _img(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def _chat(*parts, **extra) -> dict:
    return {"messages": [{"role": "user", "content": [{"type": "text", "text": "What is it?"}, *parts]}],
            "max_tokens": 2, "temperature": 0, **extra}


def _assert_serves(http):
    r = http.post(CHAT, json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})
    assert r.status_code == 200, r.text


@pytest.fixture(scope="module")
def media(tmp_path_factory):
    root = tmp_path_factory.mktemp("media")
    (root / "ok").mkdir()
    (root / "ok" / "a.png").write_bytes(PNG[0])
    (root / "secret.png").write_bytes(PNG[1])
    (root / "ok" / "escape.png").symlink_to(root / "secret.png")
    return root


@pytest.fixture(scope="module")
def image_server(serve_engine, media):
    engine = ImageEngine(serve_engine)
    srv = ServerThread(engine, ServingConfig(host="127.0.0.1", port=0, served_model_names=("tiny",),
                                             limit_mm_per_prompt={"image": 2}, responses_store="none", chat_template=TEMPLATE,
                                             allowed_local_media_path=str(media / "ok")))
    with httpx.Client(base_url=srv.base, timeout=60) as c:
        yield engine, c
    srv.stop()


def test_text_only_model_refuses_images_naming_the_part(http):
    for body in (_chat(_img(data_url(PNG[0]))), _chat(_img(data_url(PNG[0])), stream=True)):
        r = http.post(CHAT, json=body)
        assert r.status_code == 400, r.text
        err = assert_error_shape(r.json(), 400, "messages[0].content[1].image_url")
        assert "does not take images" in err["message"]
    r = http.post("/tokenize", json={"messages": _chat(_img(data_url(PNG[0])))["messages"]})
    assert_error_shape(r.json(), 400, "messages[0].content[1].image_url")
    r = http.post("/v1/responses", json={"input": [{"role": "user", "content": [
        {"type": "input_text", "text": "What?"}, {"type": "input_image", "image_url": data_url(PNG[0])}]}],
        "store": False, "max_output_tokens": 2})
    assert "does not take images" in assert_error_shape(r.json(), 400, "input")["message"]
    _assert_serves(http)


def test_images_reach_the_engine_in_order(image_server, media):
    engine, http = image_server
    engine.prompts.clear()
    r = http.post(CHAT, json=_chat(_img(data_url(PNG[2])), _img(f"file://{media}/ok/a.png")))
    assert r.status_code == 200, r.text
    prompt, = engine.prompts
    assert prompt["prompt"] == "<|user|>What is it?<image><image><|assistant|>"
    images = prompt["multi_modal_data"]["image"]
    assert [np.asarray(i).tolist() for i in images] == [np.asarray(pattern(6, 5, seed=s)).tolist() for s in (2, 0)]
    # A text-only request carries no multi_modal_data at all.
    engine.prompts.clear()
    _assert_serves(http)
    assert "multi_modal_data" not in engine.prompts[0]


def test_responses_input_image_flows_through_the_chat_converter(image_server):
    engine, http = image_server
    engine.prompts.clear()
    r = http.post("/v1/responses", json={"input": [{"role": "user", "content": [
        {"type": "input_text", "text": "What?"}, {"type": "input_image", "image_url": data_url(PNG[1])}]}],
        "store": False, "max_output_tokens": 2})
    assert r.status_code == 200, r.text
    images = engine.prompts[0]["multi_modal_data"]["image"]
    assert len(images) == 1 and np.asarray(images[0]).tolist() == np.asarray(pattern(6, 5, seed=1)).tolist()
    r = http.post("/v1/responses", json={"input": [{"role": "user", "content": [
        {"type": "input_image", "file_id": "file-123"}]}], "store": False})
    assert "Files API" in assert_error_shape(r.json(), 400, "input")["message"]
    r = http.post("/v1/responses", json={"input": [{"role": "user", "content": [
        {"type": "input_image", "image_url": "ftp://x/y.png"}]}], "store": False})
    assert "scheme 'ftp'" in assert_error_shape(r.json(), 400, "input")["message"]


def test_bad_images_are_400s_naming_the_part_and_the_server_keeps_serving(image_server, media):
    engine, http = image_server
    with ByteServer({"/a.png": (200, PNG[0], {}, 0.0)}) as srv:
        gone = srv.url("/missing.png")
        r = http.post(CHAT, json=_chat(_img(srv.url("/a.png"))))
        assert r.status_code == 200, r.text  # an http(s) image loads
        cases = [
            (_chat(_img(data_url(PNG[0])), _img(data_url(PNG[1])), _img(data_url(PNG[2]))),
             "messages[0].content[3].image_url", "At most 2 image(s) may be provided in one prompt."),
            (_chat(_img("data:image/png;base64,!!!")), "messages[0].content[1].image_url", "not valid base64"),
            (_chat(_img(data_url(encode(pattern(), "GIF"), "image/gif"))), "messages[0].content[1].image_url",
             "'image/gif' is not supported"),
            (_chat(_img(data_url(PNG[0])), _img(gone)), "messages[0].content[2].image_url", "answered HTTP 404"),
            (_chat(_img(f"file://{media}/secret.png")), "messages[0].content[1].image_url",
             "outside --allowed-local-media-path"),
            (_chat(_img(f"file://{media}/ok/escape.png")), "messages[0].content[1].image_url",
             "outside --allowed-local-media-path"),
            (_chat(_img("gopher://x")), "messages[0].content[1].image_url", "scheme 'gopher'"),
            (_chat({"type": "image_url", "image_url": {"url": data_url(PNG[0]), "detail": "huge"}}), "messages",
             "detail"),
            (_chat({"type": "image_url"}), "messages", "image_url"),
        ]
        for body, param, needle in cases:
            r = http.post(CHAT, json=body)
            assert r.status_code == 400, (param, r.text)
            assert needle in assert_error_shape(r.json(), 400, param)["message"], json.dumps(body)[:200]
            _assert_serves(http)


def test_flags_parse_into_the_serving_config(tmp_path):
    def config(*flags):
        return serving_config_from_args(cli.parse_args(cli.build_parser(), ["serve", *flags]))

    c = config("--limit-mm-per-prompt", '{"image": 3, "video": 0}', "--allowed-local-media-path", str(tmp_path))
    assert c.mm_limit("image") == 3 and c.allowed_local_media_path == str(tmp_path)
    assert config().mm_limit("image") == 999 and config().allowed_local_media_path is None  # vLLM's default
    for flags, needle in [(("--limit-mm-per-prompt", "{image: 3}"), "--limit-mm-per-prompt is not valid JSON"),
                          (("--limit-mm-per-prompt", '{"image": -1}'), "'image' must be a non-negative integer"),
                          (("--limit-mm-per-prompt", '{"imgs": 1}'), "unknown modality 'imgs'"),
                          (("--limit-mm-per-prompt", "[1]"), "must be a JSON object"),
                          (("--allowed-local-media-path", str(tmp_path / "no")), "is not an existing directory")]:
        with pytest.raises(ValueError, match=None) as e:
            config(*flags)
        assert needle in str(e.value)
