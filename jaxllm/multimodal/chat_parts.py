"""Chat messages with image parts -> the chat template's messages plus the images, checked.

One rule set for both ways in: ``LLM.chat`` (plain dict messages, here) and the server
(serve/images.py, on its pydantic messages).  An image part is OpenAI's ``{"type":
"image_url", "image_url": {"url": ...}}`` (or ``"image_url": "..."``, as vLLM also takes) or,
offline, vLLM's ``{"type": "image_pil", "image_pil": PIL.Image}``; the template sees HF
processors' ``{"type": "image"}`` in its place, the parts kept in order.  Each refusal is an
:class:`ImageInputError` (a ValueError) whose ``param`` names the part,
``messages[i].content[j].image_url``.
"""

from __future__ import annotations

from PIL import Image

from jaxllm.multimodal.media import MediaLimits, load_image


class ImageInputError(ValueError):
    """A refused image part; ``param`` names it (the server's 400 carries it)."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def check_image_count(fields: list[str], *, supports_images: bool, limit: int, model: str) -> None:
    """Refuses the images named by ``fields`` (in order) to a text-only model, or beyond ``limit``."""
    if not fields:
        return
    if not supports_images:
        raise ImageInputError(f"{fields[0]}: the model `{model}` does not take images (it is a text-only model); "
                              "send text only", fields[0])
    if len(fields) > limit:
        # vLLM's message, word for word.
        raise ImageInputError(f"At most {limit} image(s) may be provided in one prompt.", fields[limit])


def split_images(messages: list[dict]) -> tuple[list[dict], list[tuple[str, object]]]:
    """(the messages as the template sees them, [(field, URL string or PIL image), ...])."""
    out, found = [], []
    for i, m in enumerate(messages):
        content = m.get("content") if isinstance(m, dict) else None
        if not isinstance(content, list):
            out.append(m)
            continue
        parts = []
        for j, p in enumerate(content):
            kind = p.get("type") if isinstance(p, dict) else None
            field = f"messages[{i}].content[{j}].{kind}"
            if kind == "image_url":
                url = p.get("image_url")
                url = url.get("url") if isinstance(url, dict) else url
                if not isinstance(url, str):
                    raise ImageInputError(f"{field}: needs a url string", field)
                found.append((field, url))
                parts.append({"type": "image"})
            elif kind == "image_pil":
                if not isinstance(p.get("image_pil"), Image.Image):
                    raise ImageInputError(f"{field}: needs a PIL.Image", field)
                found.append((field, p["image_pil"]))
                parts.append({"type": "image"})
            else:
                parts.append(p)
        out.append({**m, "content": parts} if any(f[0].startswith(f"messages[{i}].") for f in found) else m)
    return out, found


def load(field: str, source, limits: MediaLimits) -> Image.Image:
    """One part's image, decoded to RGB; an ImageInputError naming the part."""
    if isinstance(source, Image.Image):
        return source if source.mode == "RGB" else source.convert("RGB")
    try:
        return load_image(source, limits=limits)
    except ValueError as e:
        raise ImageInputError(f"{field}: {e}", field) from None
