"""jaxllm/multimodal/chat_parts.py: image parts -> the template's ``{"type": "image"}`` in order plus
the images; the text-only and limit refusals name the part."""

from __future__ import annotations

import pytest

from jaxllm.multimodal.chat_parts import ImageInputError, check_image_count, load, split_images
from jaxllm.multimodal.media import MediaLimits
from support.images import data_url, encode, pattern


def test_split_keeps_the_parts_in_order_and_names_each_image():
    pil = pattern(3, 2, seed=5)
    msgs = [{"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:a"}},
                                         {"type": "text", "text": "and"},
                                         {"type": "image_pil", "image_pil": pil},
                                         {"type": "image_url", "image_url": "data:b"}]},
            {"role": "user", "content": [{"type": "text", "text": "plain"}]}]
    out, found = split_images(msgs)
    assert out[0] is msgs[0] and out[2] is msgs[2]  # messages without images pass untouched
    assert out[1]["content"] == [{"type": "image"}, {"type": "text", "text": "and"}, {"type": "image"},
                                 {"type": "image"}]
    assert found == [("messages[1].content[0].image_url", "data:a"), ("messages[1].content[2].image_pil", pil),
                     ("messages[1].content[3].image_url", "data:b")]
    for bad, field in (({"type": "image_url", "image_url": {}}, "messages[0].content[0].image_url"),
                       ({"type": "image_pil", "image_pil": "x"}, "messages[0].content[0].image_pil")):
        with pytest.raises(ImageInputError) as e:
            split_images([{"role": "user", "content": [bad]}])
        assert e.value.param == field


def test_text_only_and_limit_refusals_name_the_part():
    fields = ["messages[0].content[0].image_url", "messages[0].content[1].image_url"]
    check_image_count([], supports_images=False, limit=0, model="m")  # no images: nothing to refuse
    check_image_count(fields, supports_images=True, limit=2, model="m")
    with pytest.raises(ImageInputError, match="`m` does not take images") as e:
        check_image_count(fields, supports_images=False, limit=9, model="m")
    assert e.value.param == fields[0]
    with pytest.raises(ImageInputError, match=r"^At most 1 image\(s\) may be provided in one prompt\.$") as e:
        check_image_count(fields, supports_images=True, limit=1, model="m")
    assert e.value.param == fields[1]


def test_load_names_the_part():
    img = load("f", data_url(encode(pattern(4, 4), "PNG")), MediaLimits())
    assert img.size == (4, 4) and load("f", pattern(2, 2).convert("L"), MediaLimits()).mode == "RGB"
    with pytest.raises(ImageInputError, match="^messages\\[0\\].content\\[1\\].image_url: image url scheme") as e:
        load("messages[0].content[1].image_url", "ftp://x", MediaLimits())
    assert e.value.param == "messages[0].content[1].image_url"
