"""A chat message's images, in the one form every API hands the input processor.

    content: str                          a message without images: exactly as before images
    content: [{"type": "text", "text": str}
              | {"type": "image", "image": PIL.Image.Image}, ...]
                                          a message with images: its parts in the client's order;
                                          each image decoded, pixels loaded, within ImageLimits

Each API turns its own parts into these, an image first as an `ImageRef` (what the request
names and where), then the route calls `load_images` once: every image of the request is
fetched and decoded concurrently (frontend/multimodal/fetch.py), off the event loop. The
offline `LLM` has no loop and fetches nothing: `offline_messages`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

from PIL import Image

from common.errors import InvalidRequest
from frontend.multimodal import images
from frontend.multimodal.images import ImageLimits

REMOTE_SCHEMES = ("http://", "https://")
LIMITS = ImageLimits()


@dataclass(frozen=True)
class ImageRef:
    """An image as a request names it, not yet decoded: a URL (data: or http(s)), base64
    data with its media type (Anthropic), or a file's bytes (gRPC). Exactly one of url / data."""

    part: str  # where the request holds it, for errors: messages[0].content[1].image_url
    url: str | None = None
    data: str | bytes | None = None
    media_type: str | None = None  # with base64 `data`

    @property
    def remote(self) -> bool:
        return self.url is not None and self.url.strip().lower().startswith(REMOTE_SCHEMES)


def text_part(text: str) -> dict:
    return {"type": "text", "text": text}


def image_part(image: Image.Image | ImageRef) -> dict:
    return {"type": "image", "image": image}


def is_image(part: dict) -> bool:
    return part.get("type") == "image"


def collapse(parts: list[dict]) -> str | list[dict]:
    """A message's parts as its content: without an image, its text parts joined (what every
    API sent the template before images); with one, the parts."""
    if any(is_image(p) for p in parts):
        return parts
    return "".join(p["text"] for p in parts)


def count_images(messages: list[dict]) -> int:
    return sum(is_image(p) for m in messages if isinstance(m.get("content"), list) for p in m["content"])


def only_in_user(parts: list[dict], role: str, where: str) -> None:
    """Images go in user messages only (OpenAI's and Anthropic's rule): a template shows
    them there, and the tool prompts rewrite the other roles' content as text."""
    if role != "user" and any(is_image(p) for p in parts):
        raise InvalidRequest(f"{where}: images are taken in user messages only, not in a {role} message")


def url_ref(url: object, part: str) -> ImageRef:
    """An image URL field (OpenAI's image_url.url, a Responses input_image's image_url)."""
    if not isinstance(url, str) or not url.strip():
        raise InvalidRequest(f"{part}: must be a data URL (data:image/png;base64,...) or an http(s) URL")
    return ImageRef(part, url=url)


async def load_images(messages: list[dict], load: Callable[[ImageRef], Awaitable[Image.Image]],
                      check: Callable[[int], None] | None = None) -> list[dict]:
    """The messages with every ImageRef replaced by its image, loaded concurrently by `load`
    (MediaFetcher.load); the first failure cancels the rest and is raised. `check`: called
    with the number of images first (InputProcessor.check_images: may the prompt have them?)."""
    refs = [p["image"] for m in messages if isinstance(m.get("content"), list) for p in m["content"] if _pending(p)]
    if check is not None:
        check(len(refs))
    if not refs:
        return messages
    tasks = [asyncio.ensure_future(load(ref)) for ref in refs]
    try:
        loaded = iter(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:
            task.cancel()
        raise
    return [{**m, "content": [image_part(next(loaded)) if _pending(p) else p for p in m["content"]]}
            if isinstance(m.get("content"), list) else m for m in messages]


def _pending(part: dict) -> bool:
    return is_image(part) and isinstance(part["image"], ImageRef)


def decode(ref: ImageRef, limits: ImageLimits = LIMITS) -> Image.Image:
    """An image that needs no fetch: a data URL, base64 with its media type, or bytes."""
    if isinstance(ref.data, bytes):
        return images.from_bytes(ref.data, ref.part, limits)
    if ref.data is not None:
        return images.from_base64(ref.data, ref.media_type or "", ref.part, limits)
    if ref.remote:
        raise InvalidRequest(f"{ref.part}: URLs are not fetched here; send the image itself (a data URL)")
    if not ref.url.strip().lower().startswith("data:"):
        raise InvalidRequest(f"{ref.part}: not an image URL; send a data URL (data:image/png;base64,...) "
                             "or an http(s) URL")
    return images.from_data_url(ref.url, ref.part, limits)


def offline_messages(messages: list[dict], limits: ImageLimits = LIMITS) -> list[dict]:
    """The offline `LLM.chat`'s messages in the normalized form. A message's content may be a
    list of parts: {"type": "text", "text"}, {"type": "image", "image": a PIL image, a path
    or a data URL}, or OpenAI's {"type": "image_url", "image_url": {"url": a data URL}}.
    Nothing is fetched: an http(s) URL is refused."""
    out = []
    for i, m in enumerate(messages):
        content = m.get("content") if isinstance(m, dict) else None
        if not isinstance(content, list):
            out.append(m)
            continue
        parts = [_offline_part(p, f"messages[{i}].content[{j}]", limits) for j, p in enumerate(content)]
        out.append({**m, "content": collapse(parts)})
    return out


def _offline_part(part: object, where: str, limits: ImageLimits) -> dict:
    kind = part.get("type") if isinstance(part, dict) else None
    if kind == "text" and isinstance(part.get("text"), str):
        return text_part(part["text"])
    if kind == "image_url":
        url = part.get("image_url")
        url = url.get("url") if isinstance(url, dict) else url
        return image_part(decode(url_ref(url, f"{where}.image_url"), limits))
    if kind == "image":
        return image_part(offline_image(part.get("image"), f"{where}.image", limits))
    raise InvalidRequest(f"{where}: a part is {{'type': 'text', 'text': str}}, {{'type': 'image', 'image': "
                         "PIL image | path}} or {'type': 'image_url', 'image_url': {'url': data URL}}")


def offline_image(image: object, where: str, limits: ImageLimits = LIMITS) -> Image.Image:
    """An image the offline API was given: a PIL image, a path, or a data URL."""
    if isinstance(image, Image.Image):
        return images.loaded(image, where, limits)
    if isinstance(image, str) and image.strip().lower().startswith(("data:", *REMOTE_SCHEMES)):
        return decode(ImageRef(where, url=image), limits)
    if isinstance(image, (str, Path)):
        path = Path(image)
        try:
            if path.stat().st_size > limits.max_bytes:
                raise InvalidRequest(f"{where}: {path} is over {limits.max_bytes:,} bytes")
            data = path.read_bytes()
        except OSError as e:
            raise InvalidRequest(f"{where}: cannot read {path}: {e.strerror or e}") from None
        return images.from_bytes(data, where, limits)
    raise InvalidRequest(f"{where}: must be a PIL image, a path or a data URL, got {type(image).__name__}")

