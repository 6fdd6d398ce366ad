"""What a vision-language model adds to a language model, and what one step hands it.

A vision-language model is a language model (the Llama family's layers, engine/models/llama.py
and friends) plus a vision encoder. The engine runs the encoder on an image's preprocessed
pixels once (engine/encoder_cache.py keeps its output until the image's last placeholder token
is prefilled), and the step that prefills an image's placeholder tokens hands the model a
`MultiModalStep`: which rows of the flat token batch take image embeddings instead of token
embeddings, and those embeddings. A model with multi-dimensional rotary positions (Qwen2-VL's
M-RoPE) also gets each row's positions there.

A model class that takes images implements:

    embed_images(pixels: list[Tensor], grids: list[tuple[int, int, int] | None]) -> list[Tensor]
        Each image's embeddings, [num_placeholder_tokens_i, hidden] (Qwen3-VL: wider, see
        MultiModalStep.embeds) in the model's dtype, for
        the images' preprocessed pixels as the frontend computed them (frontend/multimodal/:
        Qwen2-VL's patch rows [patches, C * temporal_patch * patch^2] and (t, h, w) grid;
        Gemma 3's [3, H, W] image and no grid). Called with every image a step needs
        encoded, so it may batch them.

    image_token_id: int
        The placeholder token whose rows take image embeddings.

    num_image_tokens(shape: tuple[int, ...], grid: tuple[int, int, int] | None) -> int
        How many placeholder tokens an image of these preprocessed pixels has; raises
        ValueError when the shape (or grid) is not one this model's encoder takes.

    mrope_positions(prompt_token_ids: list[int], grids: list[tuple[int, int, int]]) -> (np.ndarray, int)
        Only for M-RoPE models: the prompt's positions [3, len(prompt)] (int64) and the delta
        that continues them (a token at sequence index i >= len(prompt) is at i + delta in
        all three), as HF's get_rope_index computes them.

and reads `ctx.mm` (a ForwardContext field, None in a step without images) in its forward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class MultiModalStep:
    """One forward pass's image inputs."""

    rows: torch.Tensor  # [N] int64: rows of the step's flat token batch that are image placeholders
    # [N, hidden]: their embeddings, in the model's dtype, row for row. Qwen3-VL's DeepStack:
    # [N, hidden * (1 + k)], the embeddings then k levels added after decoder layers 0 .. k-1.
    embeds: torch.Tensor
    # M-RoPE models: [3, T] int64 positions of every row of the step (text rows: the sequence
    # position, + the request's delta after an image). None: the step's `positions`.
    rope_positions: torch.Tensor | None = None
