"""Images as the APIs send them, decoded with PIL within limits, or an InvalidRequest (400 /
INVALID_ARGUMENT) that names the part: an OpenAI `data:` URL, an Anthropic base64 block's data
and media type, or raw bytes (gRPC). Nothing here fetches a URL.

Decoding is two steps so that a hostile file costs little: the header first (format and
size, which PIL reads without decoding pixels), checked against the limits, then the pixels.
A PNG that claims 100,000 x 100,000 is refused before a byte of it is inflated.
"""

from __future__ import annotations

import base64
import binascii
import io
import re
from dataclasses import dataclass

from PIL import Image, UnidentifiedImageError

from common.errors import InvalidRequest

FORMATS = ("PNG", "JPEG", "WEBP", "GIF")  # what OpenAI's and Anthropic's APIs take
MEDIA_TYPES = {"image/png", "image/jpeg", "image/jpg", "image/webp", "image/gif"}
_DATA_URL = re.compile(r"data:(?P<type>[^;,]*)(?P<params>(?:;[^;,]*)*),(?P<data>.*)", re.DOTALL)


@dataclass(frozen=True)
class ImageLimits:
    max_bytes: int = 20 * 2**20  # OpenAI's limit per image
    max_pixels: int = 8192 * 8192


def from_data_url(url: str, part: str, limits: ImageLimits = ImageLimits()) -> Image.Image:
    """`data:image/png;base64,...` (an OpenAI image_url, a Responses input_image)."""
    match = _DATA_URL.fullmatch(url.strip())
    if match is None:
        raise InvalidRequest(f"{part}: not a data URL (want data:image/png;base64,...)")
    params = [p.strip().lower() for p in match["params"].split(";") if p.strip()]
    if "base64" not in params:
        raise InvalidRequest(f"{part}: the data URL must be base64 (data:<type>;base64,...)")
    return from_base64(match["data"], match["type"].strip().lower(), part, limits)


def from_base64(data: str, media_type: str, part: str, limits: ImageLimits = ImageLimits()) -> Image.Image:
    """Base64 image data of `media_type` (an Anthropic image block's source)."""
    if media_type not in MEDIA_TYPES:
        raise InvalidRequest(f"{part}: media type {media_type or '(none)'!r} is not an image this server "
                             f"takes ({', '.join(sorted(MEDIA_TYPES))})")
    if len(data) * 3 // 4 > limits.max_bytes:  # before decoding a byte of it
        raise InvalidRequest(f"{part}: the image is over {limits.max_bytes:,} bytes")
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidRequest(f"{part}: the image data is not valid base64") from None
    return from_bytes(raw, part, limits)


def from_bytes(data: bytes, part: str, limits: ImageLimits = ImageLimits()) -> Image.Image:
    """An image file's bytes, decoded (its pixels loaded) once its header passes the limits."""
    if len(data) > limits.max_bytes:
        raise InvalidRequest(f"{part}: the image is over {limits.max_bytes:,} bytes")
    try:
        image = Image.open(io.BytesIO(data))
    except Image.DecompressionBombError:  # PIL's own bound (past ours): a header claiming billions
        raise InvalidRequest(f"{part}: the image is over {limits.max_pixels:,} pixels") from None
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError):
        raise InvalidRequest(f"{part}: not an image this server can read ({', '.join(FORMATS)})") from None
    if image.format not in FORMATS:
        raise InvalidRequest(f"{part}: {image.format} images are not taken ({', '.join(FORMATS)})")
    return loaded(image, part, limits)


def loaded(image: Image.Image, part: str, limits: ImageLimits = ImageLimits()) -> Image.Image:
    """An opened image (a file's, or a PIL image a caller made) within the pixel limit, then
    its pixels loaded."""
    width, height = image.size
    if width <= 0 or height <= 0:
        raise InvalidRequest(f"{part}: the image is empty ({width} x {height})")
    if width * height > limits.max_pixels:
        raise InvalidRequest(f"{part}: the image is {width} x {height}, over {limits.max_pixels:,} pixels")
    try:
        image.load()
    except (Image.DecompressionBombError, OSError, SyntaxError, ValueError):
        raise InvalidRequest(f"{part}: the image data is broken (truncated or corrupt)") from None
    return image
