"""An image of a prompt as it crosses from the frontend to the engine: its preprocessed pixels,
a hash of them, and the placeholder tokens its embeddings replace.

The hash is of the pixels the encoder sees (after resizing and normalizing), not of the file a
client sent: two encodings of one picture that preprocess alike share a prefix-cache entry, and
a changed pixel never does. It keys the prefix cache (`image_block_keys`), so blocks that hold an
image's tokens are shared only by prompts with the same image at the same place.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

IMAGES_KEY = "images"  # the tag of a request's image entry in its prefix-cache extra keys
# The preprocessed pixels (float32) one request may carry, all its images together: a
# 1024x1024 image is 25.8 MB for Qwen2.5-VL, one at its largest (max_pixels) 308 MB. The
# frontend refuses more with a 400; the engine's socket takes messages this large.
MAX_PIXEL_BYTES = 512 * 2**20


@dataclass(eq=False)
class ImageInput:
    pixels: np.ndarray  # float32, the vision encoder's input for this image
    grid: tuple[int, int, int] | None  # the patch grid (t, h, w) where the family has one
    hash: str  # image_hash(pixels, grid)
    offset: int  # its first placeholder token's index in the prompt
    length: int  # its placeholder tokens (one embedding each)

    @property
    def end(self) -> int:
        return self.offset + self.length


def image_hash(pixels: np.ndarray, grid: tuple[int, int, int] | None) -> str:
    """A content hash of preprocessed pixels (about 15 ms for a 1024x1024 image's)."""
    digest = hashlib.blake2b(digest_size=16)
    digest.update(repr((pixels.dtype.str, pixels.shape, grid)).encode())
    digest.update(np.ascontiguousarray(pixels).data)
    return digest.hexdigest()


def with_images(extra_keys: tuple, images: list[ImageInput]) -> tuple:
    """A request's prefix-cache extra keys (common/prefix_hash.py) with its images: one last
    entry (IMAGES_KEY, ((offset, hash), ...)); `extra_keys` as it was without images."""
    if not images:
        return extra_keys
    return (*extra_keys, (IMAGES_KEY, tuple((im.offset, im.hash) for im in images)))


def image_block_keys(extra_keys: tuple, index: int, block_size: int) -> tuple:
    """Block `index`'s extra keys: the request's own, its image entry replaced by the hashes of
    the images whose first placeholder token is in this block (none: dropped). The block hashes
    chain, so every later block differs too when an image does; blocks before the first image
    hash as a text-only prompt's do, so a prompt with an image still shares a text prefix."""
    if not extra_keys or not isinstance(extra_keys[-1], tuple) or extra_keys[-1][:1] != (IMAGES_KEY,):
        return extra_keys
    *base, (_, images) = extra_keys
    start = index * block_size
    hashes = tuple(h for offset, h in images if start <= offset < start + block_size)
    return (*base, (IMAGES_KEY, hashes)) if hashes else tuple(base)


def whole_image_end(images: list[ImageInput], start: int, end: int) -> int:
    """The end of a prefill chunk [start, end) cut so that it ends inside no image, for a model
    whose image tokens attend to each other both ways (Gemma 3): before the image it would
    split, or `start` (nothing this step) when the chunk starts inside that image, whose rest
    must then come whole in a later step. `images` by offset, apart."""
    for im in images:
        if im.offset < end < im.end:
            return im.offset if im.offset > start else start
    return end
