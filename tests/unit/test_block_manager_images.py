"""The prefix cache with images (common/multimodal.py): blocks holding an image's tokens are
shared only by prompts with the same image at the same place; text before the first image is
shared with any prompt; the router hashes blocks as the engine does."""

from __future__ import annotations

import numpy as np

from common.multimodal import ImageInput, image_block_keys, image_hash, with_images
from engine.block_manager import BlockManager
from frontend.router import prompt_block_hashes

BS = 4
IMAGE_TOKEN = 99


def image(offset: int, length: int, seed: int) -> ImageInput:
    pixels = np.random.default_rng(seed).random((length * 4, 6), dtype=np.float32)
    return ImageInput(pixels, (1, 2, 2 * length), image_hash(pixels, (1, 2, 2 * length)), offset, length)


def prompt_with(images: list[ImageInput], length: int = 24, text: int = 0) -> list[int]:
    ids = [1000 + text * 100 + i for i in range(length)]
    for im in images:
        ids[im.offset:im.end] = [IMAGE_TOKEN] * im.length
    return ids


def cached_tokens(bm: BlockManager, seq_id: str, ids: list[int], keys: tuple) -> int:
    computed, num_cached = bm.get_computed_blocks(ids, keys)
    assert bm.allocate(seq_id, ids, len(ids), computed, keys)
    return num_cached


def test_same_image_hits_and_another_image_misses_after_the_shared_text():
    bm = BlockManager(32, block_size=BS)
    first = [image(6, 8, seed=0)]
    ids = prompt_with(first)
    assert cached_tokens(bm, "a", ids, with_images((), first)) == 0
    assert cached_tokens(bm, "b", ids, with_images((), first)) == 20  # all but the block of the last token
    other = [image(6, 8, seed=1)]  # same tokens, other pixels
    # blocks 0 (tokens 0-3) is text only: shared; block 1 holds the image's start: missed
    assert cached_tokens(bm, "c", ids, with_images((), other)) == 4
    bm.check_invariants()


def test_a_hash_enters_only_the_block_where_its_image_starts():
    keys = with_images(("lora", "x", "/p"), [image(6, 8, seed=0), image(16, 3, seed=1)])
    assert image_block_keys(keys, 0, BS) == ("lora", "x", "/p")
    assert image_block_keys(keys, 1, BS)[-1][1] == (keys[-1][1][0][1],)
    assert image_block_keys(keys, 2, BS) == ("lora", "x", "/p")  # inside the first image: chained
    assert image_block_keys(keys, 4, BS)[-1][1] == (keys[-1][1][1][1],)
    assert image_block_keys(("lora", "x", "/p"), 1, BS) == ("lora", "x", "/p")
    assert with_images((), []) == ()


def test_image_hash_is_of_pixels_and_grid():
    a = np.zeros((4, 6), dtype=np.float32)
    b = a.copy()
    b[3, 5] = 1e-7  # one changed pixel
    assert image_hash(a, (1, 2, 2)) == image_hash(a.copy(), (1, 2, 2))
    assert image_hash(a, (1, 2, 2)) != image_hash(b, (1, 2, 2))
    assert image_hash(a, (1, 2, 2)) != image_hash(a, (1, 1, 4))


def test_the_router_hashes_blocks_as_the_engine_does():
    bm = BlockManager(32, block_size=BS)
    images = [image(6, 8, seed=0)]
    ids, keys = prompt_with(images), with_images((), images)
    cached_tokens(bm, "a", ids, keys)
    engine_hashes = [bm._blocks[b].block_hash for b in bm.block_table("a")[:5]]
    assert prompt_block_hashes(ids, BS, keys) == engine_hashes
