"""A prompt's images, made what the engine takes: each image preprocessed by the model's own
image processor, its placeholder expanded into the image's tokens (so the prompt's length,
`max_tokens` checks and usage count them before the engine sees it), and hashed by content.
Built from the engine's handshake (ipc.MultiModalInfo)."""

from __future__ import annotations

import json
import math

from common.errors import InvalidRequest
from common.multimodal import MAX_PIXEL_BYTES, ImageInput, image_hash
from common.v1 import engine_ipc_pb2 as ipc
from frontend.multimodal.families import FAMILIES
from frontend.multimodal.image_processors import ImageProcessor


class MultiModalProcessor:
    def __init__(self, info: ipc.MultiModalInfo, tokenizer) -> None:
        if info.model_type not in FAMILIES:
            raise ValueError(f"images: no prompt settings for {info.model_type!r} (known: {', '.join(FAMILIES)})")
        self.family = FAMILIES[info.model_type]
        config = json.loads(info.preprocessor_config)
        self.images = ImageProcessor(info.model_type, config)
        self.tokenizer = tokenizer
        self.image_token_id = info.image_token_id
        self.image_token = tokenizer.convert_ids_to_tokens(info.image_token_id)
        self.tokens_per_image = info.tokens_per_image  # 0: from each image's grid
        self.merge_size = int(config.get("merge_size", 1))

    def prompt(self, text: str, images: list, field: str = "prompt", add_special_tokens: bool = False
               ) -> tuple[list[int], list[ImageInput]]:
        """The token ids of `text` with one image per placeholder, in order, and the images as
        the engine takes them. `add_special_tokens`: False for a chat template's text (it
        writes BOS and friends itself), True for a plain prompt."""
        pieces = text.split(self.family.placeholder)
        if len(pieces) - 1 != len(images):
            raise InvalidRequest(f"{field}: {len(images)} image(s) for {len(pieces) - 1} image placeholder(s) "
                                 f"({self.family.placeholder}) in the prompt")
        processed = self.images(images)
        size = sum(p.pixels.nbytes for p in processed)
        if size > MAX_PIXEL_BYTES:
            raise InvalidRequest(f"{field}: the images make {size / 2**20:,.0f} MiB of pixels for the model, more "
                                 f"than the {MAX_PIXEL_BYTES // 2**20} MiB a request may carry; send fewer or smaller "
                                 "images")
        counts = [self._num_tokens(p.grid) for p in processed]
        expanded = pieces[0] + "".join(self.family.expand(self.image_token, n) + piece
                                       for n, piece in zip(counts, pieces[1:]))
        ids = self.tokenizer.encode(expanded, add_special_tokens=add_special_tokens)
        runs = _runs(ids, self.image_token_id)
        if [n for _, n in runs] != counts:  # the text had image tokens of its own
            raise InvalidRequest(f"{field}: the prompt's text has image tokens ({self.image_token}) of its own")
        return ids, [ImageInput(p.pixels, p.grid, image_hash(p.pixels, p.grid), offset, n)
                     for p, (offset, n) in zip(processed, runs)]

    def _num_tokens(self, grid: tuple[int, int, int] | None) -> int:
        if grid is None:
            return self.tokens_per_image
        return math.prod(grid) // (self.merge_size * self.merge_size)


def _runs(ids: list[int], token: int) -> list[tuple[int, int]]:
    """(start, length) of each maximal run of `token` in `ids`."""
    runs, start = [], None
    for i, t in enumerate([*ids, None]):
        if t == token and start is None:
            start = i
        elif t != token and start is not None:
            runs.append((start, i - start))
            start = None
    return runs
