"""Qwen3-VL (the dense models): Qwen3's language model with interleaved M-RoPE and DeepStack,
and a vision tower whose embeddings take the place of the prompt's <|image_pad|> tokens.

The frontend hands over an image as Qwen2.5-VL's (HF's Qwen2VLImageProcessor, patches of 16
pixels): patch rows [patches, C * temporal * patch^2] in (t, h/m, w/m, m, m) order and the
(t, h, w) grid. The tower, as HF's Qwen3VLVisionModel:

    patch embed   a matmul (with bias) per row, plus a learned position embedding: HF's square
                  table of num_position_embeddings, bilinearly resampled to the image's grid
    blocks        LayerNorm, attention with 2-D rotary over each whole frame (no windows),
                  LayerNorm, GELU-tanh MLP
    merger        LayerNorm, each m*m rows concatenated, MLP: one token of the LM's width
    DeepStack     the output of each block in deepstack_visual_indexes through a merger of its
                  own (LayerNorm after the concatenation): one more token per m*m rows each

`embed_images` hands out, per image, [tokens, hidden * (1 + k)]: the merger's embeddings, then
the k DeepStack levels in block order. The language model (engine/models/llama.py) puts the
first in the image rows and adds level i to their hidden states after decoder layer i.

Everything else is Qwen2.5-VL's (engine/models/qwen2_5_vl.py): image token counts, the M-RoPE
positions of a prompt, checkpoint loading in both tensor-name layouts.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.layers import Layer
from engine.layers.parallel import SINGLE, TPShard
from engine.layers.rotary import MRotaryEmbedding
from engine.models import qwen2_5_vl
from engine.models.config import ModelArchConfig
from engine.models.llama import LlamaForCausalLM

VISION_EPS = 1e-6  # HF's vision LayerNorms


class Qwen3VLForConditionalGeneration(qwen2_5_vl.Qwen2_5_VLForConditionalGeneration):
    """Qwen2.5-VL's class (embed_images, num_image_tokens, mrope_positions, load_weights) with
    Qwen3's layers (q/k norm, from the config), interleaved M-RoPE and Qwen3-VL's tower."""

    def __init__(self, cfg: ModelArchConfig, max_positions: int, shard: TPShard = SINGLE) -> None:
        LlamaForCausalLM.__init__(self, cfg, max_positions, shard)  # not Qwen2.5-VL's: its tower differs
        v = cfg.vision
        self.image_token_id = v["image_token_id"]
        self.model.rotary = MRotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling,
                                             v["mrope_section"], interleaved=True)
        self.visual = VisionTransformer(v)


class VisionTransformer(nn.Module):
    """HF's module names (checkpoints load as stored), `patch_embed.proj` a Linear."""

    def __init__(self, v: dict) -> None:
        super().__init__()
        self.config, self.merge = v, v["spatial_merge_size"]
        self.head_dim = v["hidden_size"] // v["num_heads"]
        self.side = int(v["num_position_embeddings"] ** 0.5)  # the learned table is side x side
        width = v["in_channels"] * v["temporal_patch_size"] * v["patch_size"] ** 2
        dim, unit = v["hidden_size"], self.merge ** 2
        self.patch_embed = nn.ModuleDict({"proj": nn.Linear(width, dim)})
        self.pos_embed = nn.Embedding(v["num_position_embeddings"], dim)
        self.blocks = nn.ModuleList(VisionBlock(dim, v["num_heads"], v["intermediate_size"], v["gelu_tanh"])
                                    for _ in range(v["depth"]))
        self.merger = PatchMerger(dim, v["out_hidden_size"], unit, postshuffle_norm=False)
        self.deepstack_merger_list = nn.ModuleList(PatchMerger(dim, v["out_hidden_size"], unit, postshuffle_norm=True)
                                                   for _ in v["deepstack_visual_indexes"])
        self.deepstack = {block: i for i, block in enumerate(v["deepstack_visual_indexes"])}  # block -> its merger

    def forward(self, pixels: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        """Patch rows [N, width] of the images, one after another -> [N / m^2, out_hidden * (1 + k)]."""
        device, proj = pixels.device, self.patch_embed["proj"]
        positions = qwen2_5_vl.patch_positions(grids, self.merge)
        x = proj(pixels.to(proj.weight.dtype))
        x = x + self._position_embeddings(positions, grids).to(x.dtype)
        rope = qwen2_5_vl.axial_rope(positions.to(device), self.head_dim, self.config["rope_theta"])
        frames = qwen2_5_vl.segment_groups([h * w for t, h, w in grids for _ in range(t)], device)
        levels = []
        for i, block in enumerate(self.blocks):
            x = block(x, rope, frames)
            if i in self.deepstack:
                levels.append(self.deepstack_merger_list[self.deepstack[i]](x))
        return torch.cat([self.merger(x), *levels], dim=-1)

    def _position_embeddings(self, positions: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        """[N, hidden]: the learned table resampled to each image's h x w grid, as HF's
        bilinear interpolation with aligned corners (the grid's first and last patch on the
        table's first and last entry), at each row's (row, column) `positions` [N, 2]."""
        sizes = torch.cat([torch.tensor([[h, w]]).expand(t * h * w, 2) for t, h, w in grids])
        source = positions.float() * (self.side - 1) / (sizes - 1).clamp(min=1)  # [N, 2] in table units
        floor = source.floor()
        offsets = torch.arange(2)
        taps = (floor.long()[..., None] + offsets).clamp(0, self.side - 1)  # [N, (row, col), 2]
        weights = (1 - (source[..., None] - floor[..., None] - offsets).abs()).clamp(min=0)
        index = (taps[:, 0, :, None] * self.side + taps[:, 1, None, :]).flatten(1)  # [N, 4]
        weight = (weights[:, 0, :, None] * weights[:, 1, None, :]).flatten(1)
        device = self.pos_embed.weight.device
        return (self.pos_embed(index.to(device)) * weight.to(device)[:, :, None]).sum(1)


class VisionBlock(Layer):
    def __init__(self, dim: int, num_heads: int, intermediate_size: int, gelu_tanh: bool) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=VISION_EPS)
        self.norm2 = nn.LayerNorm(dim, eps=VISION_EPS)
        self.attn = qwen2_5_vl.VisionAttention(dim, num_heads)
        self.mlp = VisionMLP(dim, intermediate_size, gelu_tanh)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], segments: list[torch.Tensor]
                ) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), rope, segments)
        return x + self.mlp(self.norm2(x))


class VisionMLP(Layer):
    def __init__(self, dim: int, intermediate_size: int, gelu_tanh: bool) -> None:
        super().__init__()
        self.linear_fc1 = nn.Linear(dim, intermediate_size)
        self.linear_fc2 = nn.Linear(intermediate_size, dim)
        self.approximate = "tanh" if gelu_tanh else "none"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(F.gelu(self.linear_fc1(x), approximate=self.approximate))


class PatchMerger(Layer):
    """LayerNorm, then each m*m rows as one, MLP; `postshuffle_norm` (DeepStack's): the norm
    after the concatenation, over all m*m rows together."""

    def __init__(self, dim: int, out_dim: int, unit: int, postshuffle_norm: bool) -> None:
        super().__init__()
        self.width, self.postshuffle_norm = dim * unit, postshuffle_norm
        self.norm = nn.LayerNorm(self.width if postshuffle_norm else dim, eps=VISION_EPS)
        self.linear_fc1 = nn.Linear(self.width, self.width)
        self.linear_fc2 = nn.Linear(self.width, out_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x.view(-1, self.width) if self.postshuffle_norm else x).view(-1, self.width)
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))
