"""The engine's image side: checks a request's images, runs the vision encoder on the images a
step needs, and hands the model their embeddings (engine/models/multimodal.py).

An image is encoded in the first step that prefills one of its placeholder tokens, with every
other image that step needs, in one `embed_images` call. Its output stays in the
`EncoderCache`, by content hash, least recently used first within a byte budget: a chunked
prefill that splits an image encodes it once, and so does a prompt that repeats an image
whose prefix-cache hit ends inside it (the image's last tokens share a block with the new
text), or a preempted request that recomputes it. A prefix-cache hit that covers an image
skips its encoder entirely: no step prefills its tokens.
"""

from __future__ import annotations

import logging
from collections import OrderedDict

import numpy as np
import torch

from common.errors import InvalidRequest
from common.v1 import engine_ipc_pb2 as ipc
from engine.models.multimodal import MultiModalStep
from engine.outputs import ScheduledRequest
from engine.request import Request

log = logging.getLogger(__name__)

# Encoder outputs kept at most, least recently used dropped first. 256 MiB holds 26 images of
# 1369 tokens (1024 x 1024 pixels) at Qwen2.5-VL-7B's width in bfloat16.
ENCODER_CACHE_BYTES = 256 * 2**20


class EncoderCache:
    """Encoder outputs by image hash, least recently used first, within `max_bytes`."""

    def __init__(self, max_bytes: int = ENCODER_CACHE_BYTES) -> None:
        self.max_bytes = max_bytes
        self.num_bytes = 0
        self.num_encoded = 0  # images encoded so far (tests and metrics: a hit skips the encoder)
        self._entries: OrderedDict[str, torch.Tensor] = OrderedDict()

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: str) -> torch.Tensor:
        self._entries.move_to_end(key)
        return self._entries[key]

    def put(self, key: str, embeds: torch.Tensor) -> None:
        self.drop(key)
        self._entries[key] = embeds
        self.num_bytes += embeds.nbytes
        while self.num_bytes > self.max_bytes:
            self.drop(next(iter(self._entries)))

    def drop(self, key: str) -> None:
        embeds = self._entries.pop(key, None)
        if embeds is not None:
            self.num_bytes -= embeds.nbytes


class VisionInputs:
    """A vision-language model's images, for the model runner."""

    def __init__(self, model: torch.nn.Module, device: torch.device) -> None:
        self.model, self.device = model, device
        self.mrope = hasattr(model, "mrope_positions")
        self.cache = EncoderCache()

    def check(self, prompt: list[int], images: list) -> None:
        """InvalidRequest unless the images fit the prompt and the model: in order, apart,
        inside the prompt, each over exactly its count of placeholder tokens, shaped as the
        encoder takes them. The frontend built them so; this guards the engine's socket."""
        token, end = self.model.image_token_id, 0
        for i, im in enumerate(images):
            try:
                expected = self.model.num_image_tokens(tuple(im.pixels.shape), im.grid)
            except ValueError as e:
                raise InvalidRequest(f"images[{i}]: {e}") from None
            if im.length != expected:
                raise InvalidRequest(f"images[{i}]: {im.length} placeholder tokens, but its pixels make {expected}")
            if im.offset < end or im.end > len(prompt):
                raise InvalidRequest(f"images[{i}]: tokens [{im.offset}, {im.end}) overlap another image "
                                     f"or leave the {len(prompt)}-token prompt")
            if any(t != token for t in prompt[im.offset:im.end]):
                raise InvalidRequest(f"images[{i}]: its tokens [{im.offset}, {im.end}) are not all the image "
                                     f"token {token}")
            end = im.end

    def prepare(self, request: Request) -> None:
        """At admission: an M-RoPE model's positions of the prompt, where it has images; for a
        model whose image tokens attend both ways, whole images in every prefill chunk."""
        request.whole_images = getattr(self.model, "bidirectional_images", False)
        if self.mrope and request.images:
            table, delta = self.model.mrope_positions(request.prompt_token_ids, [im.grid for im in request.images])
            request.rope_table, request.rope_delta = np.asarray(table, dtype=np.int64), int(delta)

    def step(self, order: list[ScheduledRequest], first_row: int, steady_requests: list[Request],
             steady_positions: np.ndarray | None) -> MultiModalStep | None:
        """The step's image embeddings and, for M-RoPE, every row's positions: None when no
        row of the step needs either. `order` is the step's non-steady requests in row order
        from `first_row`, after the steady decodes (`steady_requests`, at `steady_positions`)."""
        pieces = []  # (first row, image, first token in it, token count)
        row = first_row
        for s in order:
            r = s.request
            start, end = r.num_computed_tokens, r.num_computed_tokens + s.num_new_tokens
            for im in r.images:
                lo, hi = max(im.offset, start), min(im.end, end)
                if lo < hi:
                    pieces.append((row + lo - start, im, lo - im.offset, hi - lo))
            row += s.num_new_tokens
        rope = self._rope_positions(order, steady_requests, steady_positions)
        if not pieces and rope is None:
            return None
        outputs = self._encode([im for _, im, _, _ in pieces])
        if pieces:
            rows = torch.cat([torch.arange(r0, r0 + n) for r0, _, _, n in pieces]).to(self.device)
            embeds = torch.cat([outputs[im.hash][a:a + n] for _, im, a, n in pieces])
        else:
            rows = torch.empty(0, dtype=torch.int64, device=self.device)
            embeds = None
        return MultiModalStep(rows, embeds, None if rope is None else torch.from_numpy(rope).to(self.device))

    def _encode(self, images: list) -> dict[str, torch.Tensor]:
        """Each image's encoder output by hash: from the cache, or encoded now, those in one call."""
        outputs = {im.hash: self.cache.get(im.hash) for im in images if im.hash in self.cache}
        missing = list({im.hash: im for im in images if im.hash not in outputs}.values())
        if missing:
            pixels = [torch.from_numpy(im.pixels).to(self.device) for im in missing]
            for im, out in zip(missing, self.model.embed_images(pixels, [im.grid for im in missing])):
                self.cache.put(im.hash, out)  # may drop older ones (or this one, if over budget alone)
                outputs[im.hash] = out
            self.cache.num_encoded += len(missing)
        return outputs

    def _rope_positions(self, order: list[ScheduledRequest], steady_requests: list[Request],
                        steady_positions: np.ndarray | None) -> np.ndarray | None:
        """[3, rows] M-RoPE positions, where a row of the step belongs to a prompt with images
        (else every position is the same 1-D one in all three, and the model needs none)."""
        if not self.mrope or not (any(r.rope_table is not None for r in steady_requests)
                                  or any(s.request.rope_table is not None for s in order)):
            return None
        parts = []
        if steady_requests:
            deltas = np.array([r.rope_delta for r in steady_requests], dtype=np.int64)
            parts.append(np.broadcast_to(steady_positions + deltas, (3, len(deltas))))
        for s in order:
            r = s.request
            p = np.arange(r.num_computed_tokens, r.num_computed_tokens + s.num_new_tokens, dtype=np.int64)
            if r.rope_table is None:
                parts.append(np.broadcast_to(p, (3, len(p))))
                continue
            inside = p < r.rope_table.shape[1]
            part = np.empty((3, len(p)), dtype=np.int64)
            part[:, inside] = r.rope_table[:, p[inside]]
            part[:, ~inside] = p[~inside] + r.rope_delta
            parts.append(part)
        return np.ascontiguousarray(np.concatenate(parts, axis=1))


def multimodal_info(core) -> ipc.MultiModalInfo | None:
    """What a frontend needs to put images into this model's prompts; None for a text model,
    or for a vision-language model without the preprocessor_config.json its images need."""
    vision = getattr(core.model_runner, "vision", None)
    if vision is None:
        return None
    config = core.model_path / "preprocessor_config.json"
    if not config.is_file():
        log.warning("%s has no preprocessor_config.json: serving text only", core.model_path)
        return None
    model = vision.model
    return ipc.MultiModalInfo(model_type=core.model_runner.arch.model_type, preprocessor_config=config.read_text(),
                              image_token_id=model.image_token_id,
                              tokens_per_image=getattr(model, "tokens_per_image", 0))
