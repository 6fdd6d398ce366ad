"""frontend/multimodal/images.py: images from data URLs, base64 blocks and bytes, and the
ways they go wrong (fuzzed), each an InvalidRequest naming the part, none a crash."""

from __future__ import annotations

import base64
import io
import struct
import zlib

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from PIL import Image

from common.errors import InvalidRequest
from frontend.multimodal.images import ImageLimits, from_base64, from_bytes, from_data_url

PART = "messages[0].content[1]"


def encoded(fmt: str = "PNG", size: tuple[int, int] = (40, 30), mode: str = "RGB") -> bytes:
    array = (np.random.RandomState(0).rand(size[1], size[0], len(mode)) * 255).astype(np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(array, mode).save(buffer, fmt)
    return buffer.getvalue()


def png_header(width: int, height: int) -> bytes:
    """A PNG whose header claims width x height, then an empty pixel chunk."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", b""))


@pytest.mark.parametrize("fmt,mime", [("PNG", "image/png"), ("JPEG", "image/jpeg"), ("WEBP", "image/webp"),
                                      ("GIF", "image/gif")])
def test_each_format_through_each_door(fmt, mime):
    data = encoded(fmt, mode="RGB")
    text = base64.b64encode(data).decode()
    for image in (from_data_url(f"data:{mime};base64,{text}", PART), from_base64(text, mime, PART),
                  from_bytes(data, PART)):
        assert image.format == fmt and image.size == (40, 30)
        assert np.asarray(image.convert("RGB")).shape == (30, 40, 3)  # the pixels are loaded


@pytest.mark.parametrize("url,message", [
    ("https://example.com/cat.png", "not a data URL"),
    ("data:image/png," + "AAAA", "must be base64"),
    ("data:text/plain;base64,aGVsbG8=", "media type 'text/plain'"),
    ("data:;base64,aGVsbG8=", r"media type '\(none\)'"),
    ("data:image/png;base64,not base64!", "not valid base64"),
    ("data:image/png;base64," + base64.b64encode(b"hello, not an image").decode(), "not an image this server"),
])
def test_bad_data_urls_are_named(url, message):
    with pytest.raises(InvalidRequest, match=message) as error:
        from_data_url(url, PART)
    assert str(error.value).startswith(PART)


def test_limits_and_broken_files():
    png = encoded("PNG", size=(64, 64))
    with pytest.raises(InvalidRequest, match="over 100 bytes"):
        from_bytes(png, PART, ImageLimits(max_bytes=100))
    with pytest.raises(InvalidRequest, match="over 100 bytes"):  # refused before decoding the base64
        from_base64(base64.b64encode(png).decode(), "image/png", PART, ImageLimits(max_bytes=100))
    with pytest.raises(InvalidRequest, match="64 x 64, over 1,000 pixels"):
        from_bytes(png, PART, ImageLimits(max_pixels=1000))
    with pytest.raises(InvalidRequest, match="9000 x 9000, over 67,108,864 pixels"):  # a header's claim, never inflated
        from_bytes(png_header(9000, 9000), PART)
    with pytest.raises(InvalidRequest, match="over 67,108,864 pixels"):  # past PIL's own bound too
        from_bytes(png_header(100_000, 100_000), PART)
    with pytest.raises(InvalidRequest, match="broken"):
        from_bytes(png[: len(png) // 2], PART)  # truncated: the header reads, the pixels do not
    with pytest.raises(InvalidRequest):
        from_bytes(png_header(0, 0), PART)  # zero-size
    tiff = io.BytesIO()
    Image.new("RGB", (4, 4)).save(tiff, "TIFF")
    with pytest.raises(InvalidRequest, match="TIFF images are not taken"):
        from_bytes(tiff.getvalue(), PART)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=600), st.integers(min_value=0, max_value=2000))
def test_any_bytes_give_an_image_or_an_invalid_request(noise, cut):
    """Random bytes, and a real PNG cut short and patched with them: never another exception."""
    png = encoded("PNG", size=(16, 16))
    for data in (noise, png[:cut] + noise, png[:8] + noise):
        try:
            from_bytes(data, PART)
        except InvalidRequest:
            pass
