"""Chat messages' image parts -> the images the engine takes (``multi_modal_data``), checked first.

The messages keep their parts in order for the chat template (``ChatMessage.to_template_dict``
gives each image part as HF processors' ``{"type": "image"}``); this module finds the image
parts, refuses them where they cannot be served, and fetches and decodes them
(jaxllm/multimodal/media.py) off the event loop, so a slow image host stalls only its own
request.  Each refusal is a 400 whose ``param`` names the part,
``messages[i].content[j].image_url``:

* any image to a model whose engine says ``supports_images`` is False (a text-only model);
* more images than ``--limit-mm-per-prompt`` allows (vLLM's message, word for word);
* a URL that does not load: malformed, unreachable, over the size cap, outside
  ``--allowed-local-media-path``, or not PNG/JPEG/WebP.
"""

from __future__ import annotations

import asyncio

from PIL import Image

from jaxllm.multimodal.chat_parts import ImageInputError, check_image_count
from jaxllm.multimodal.media import MediaLimits, load_image
from serve.protocol import ChatMessage, ImageURL, bad_request
from serve.state import ServerState


def image_parts(state: ServerState, messages: list[ChatMessage]) -> list[tuple[str, ImageURL]]:
    """The messages' image parts in order, each with the field that names it; a 400 when the
    model takes no images or there are more than the limit."""
    parts = [(f"messages[{i}].content[{j}].image_url", url)
             for i, m in enumerate(messages) for j, url in m.images()]
    try:
        check_image_count([f for f, _ in parts], supports_images=state.supports_images,
                          limit=state.config.mm_limit("image"), model=state.model_name)
    except ImageInputError as e:
        raise bad_request(str(e), e.param) from None
    return parts


async def load_chat_images(state: ServerState, messages: list[ChatMessage]) -> list[Image.Image]:
    """The messages' images, decoded, in order (checked by :func:`image_parts` first)."""
    parts = image_parts(state, messages)
    if not parts:
        return []
    limits = MediaLimits(allowed_local_media_path=state.config.allowed_local_media_path)
    # Fetches run in threads, together: one slow host costs one timeout, not one per image.
    return list(await asyncio.gather(*(asyncio.to_thread(_load, field, url.url, limits) for field, url in parts)))


def _load(field: str, url: str, limits: MediaLimits) -> Image.Image:
    try:
        return load_image(url, limits=limits)
    except ValueError as e:
        raise bad_request(f"{field}: {e}", field) from None


def with_images(prompt: dict, images: list[Image.Image]) -> dict:
    """The engine prompt with its images as vLLM's ``multi_modal_data`` (unchanged without any)."""
    if images:
        prompt = {**prompt, "multi_modal_data": {"image": list(images)}}
    return prompt
