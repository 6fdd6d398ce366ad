"""Qwen2.5-VL: Qwen2's language model with M-RoPE, and a vision tower whose embeddings take
the place of the prompt's <|image_pad|> tokens.

The frontend's image processor (HF's Qwen2VLImageProcessor) cuts an image into patches of
patch_size^2 pixels (each holding temporal_patch_size frames: a still image twice) and hands
them over as rows [patches, C * temporal * patch^2], each m x m square of neighbours
consecutive (m = spatial_merge_size), with the (t, h, w) patch grid:

    rows in order (t, h/m, w/m, m, m)    ->    one language-model token per m*m rows

The tower, as HF's Qwen2_5_VisionTransformerPretrainedModel:

    patch embed   a matmul per row (HF's Conv3d has stride == kernel: one output per patch)
    blocks        RMSNorm, attention with 2-D rotary (a patch's row and column), SwiGLU MLP
                  with bias. Attention stays inside windows of window_size pixels square,
                  except in the blocks of fullatt_block_indexes, which see the whole image.
    merger        RMSNorm, each m*m rows concatenated, MLP: one token of the LM's width

For the windows, the tokens of each window are made consecutive first (HF's window_index),
so every attention is over runs of rows; the merger's output goes back to the image's order.

The language model is Llama's (qkv bias, as Qwen2) with the M-RoPE table of
layers/rotary.py (MRotaryEmbedding), at the positions `mrope_positions` gives a prompt.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from engine.layers import Layer
from engine.layers.norm import RMSNorm
from engine.layers.parallel import SINGLE, TPShard
from engine.layers.quantized import QuantizedTensor
from engine.layers.rotary import MRotaryEmbedding, apply_rotary
from engine.models.config import ModelArchConfig
from engine.models.llama import LlamaForCausalLM

VISION_EPS = 1e-6  # HF's vision RMSNorms


class Qwen2_5_VLForConditionalGeneration(LlamaForCausalLM):
    """Llama's model (module names, linear_sources, logits, tensor parallelism: only the
    language model is sharded or quantized) plus `visual`, the vision tower."""

    def __init__(self, cfg: ModelArchConfig, max_positions: int, shard: TPShard = SINGLE) -> None:
        super().__init__(cfg, max_positions, shard)
        v = cfg.vision
        self.image_token_id = v["image_token_id"]
        self.model.rotary = MRotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling,
                                             v["mrope_section"])
        self.visual = VisionTransformer(v)

    @torch.no_grad()
    def embed_images(self, pixels: list[torch.Tensor], grids: list[tuple[int, int, int] | None]
                     ) -> list[torch.Tensor]:
        """Each image's embeddings [t*h*w / m^2, hidden], all images in one pass of the tower."""
        sizes = [self.num_image_tokens(tuple(p.shape), g) for p, g in zip(pixels, grids)]
        merged = self.visual(torch.cat(pixels), [tuple(g) for g in grids])
        return list(merged.split(sizes))

    def num_image_tokens(self, shape: tuple[int, ...], grid: tuple[int, int, int] | None) -> int:
        """Placeholder tokens of an image of these patch rows and grid; ValueError if the
        tower cannot take them."""
        v, m = self.visual.config, self.visual.merge
        width = v["in_channels"] * v["temporal_patch_size"] * v["patch_size"] ** 2
        if grid is None or len(grid) != 3 or min(grid) < 1:
            raise ValueError(f"qwen2_5_vl takes an image with its (t, h, w) patch grid, not {grid}")
        t, h, w = grid
        if tuple(shape) != (t * h * w, width) or h % m or w % m:
            raise ValueError(f"pixels {tuple(shape)} with grid {tuple(grid)}: want ({t * h * w}, {width}) "
                             f"and h, w multiples of {m}")
        return t * h * w // (m * m)

    def mrope_positions(self, prompt_token_ids: list[int], grids: list[tuple[int, int, int]]
                        ) -> tuple[np.ndarray, int]:
        """[3, len(prompt)] positions and the delta that continues them (HF's get_rope_index)."""
        return mrope_positions(prompt_token_ids, grids, self.image_token_id, self.visual.merge)

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor | QuantizedTensor]]) -> None:
        """Checkpoint tensors in either layout (see `our_name`): the language model's through
        Llama's loading, the tower's copied as stored (HF's Conv3d weight as our matmul's)."""
        vision = dict(self.visual.named_parameters())
        loaded: set[str] = set()

        def language() -> Iterable[tuple[str, torch.Tensor | QuantizedTensor]]:
            for name, tensor in weights:
                name = our_name(name)
                if not name.startswith("visual."):
                    yield name, tensor
                    continue
                name = name.removeprefix("visual.")
                if name not in vision:
                    raise ValueError(f"checkpoint tensor 'visual.{name}' has no place in {self.config.model_type}")
                if isinstance(tensor, QuantizedTensor):
                    tensor = tensor.dequantize()
                target = vision[name]
                if tensor.shape != target.shape and (name != "patch_embed.proj.weight"
                                                     or tensor.numel() != target.numel()):
                    raise ValueError(f"visual.{name}: checkpoint {tuple(tensor.shape)} vs {tuple(target.shape)}")
                target.copy_(tensor.reshape(target.shape))
                loaded.add(name)

        super().load_weights(language())
        missing = sorted(vision.keys() - loaded)
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} vision tensor(s), e.g. {missing[:3]}")

    def _check_all_loaded(self, names: list[str], loaded: set[str]) -> None:
        """Llama's check, for the language model (load_weights checks the tower)."""
        super()._check_all_loaded([n for n in names if not n.startswith("visual.")], loaded)


def our_name(name: str) -> str:
    """A checkpoint tensor's name in our module tree. The Hub's Qwen/Qwen2.5-VL-* checkpoints
    (and transformers 5's save_pretrained, which writes their names back) hold `visual.*`,
    `model.*` and `lm_head.weight`, which are ours; transformers' module tree since 4.52, and
    checkpoints saved from its state_dict, `model.visual.*` and `model.language_model.*`."""
    if name.startswith("model.visual."):
        return name.removeprefix("model.")
    if name.startswith("model.language_model."):
        return "model." + name.removeprefix("model.language_model.")
    return name


def mrope_positions(ids: list[int], grids: list[tuple[int, int, int]], image_token_id: int, merge: int
                    ) -> tuple[np.ndarray, int]:
    """HF's get_rope_index for images: text counts on from the last position, an image's
    tokens take (start + frame, start + row, start + column) of its merged grid, and the text
    after it starts at start + max(rows, columns). The delta is max position + 1 - len(ids)."""
    ids = np.asarray(ids, dtype=np.int64)
    out = np.empty((3, len(ids)), dtype=np.int64)
    images = iter(grids)
    i = pos = 0
    while i < len(ids):
        if ids[i] != image_token_id:
            end = i + 1
            while end < len(ids) and ids[end] != image_token_id:
                end += 1
            out[:, i:end] = np.arange(pos, pos + end - i)
            pos, i = pos + end - i, end
            continue
        grid = next(images, None)
        if grid is None:
            raise ValueError(f"prompt has more runs of image tokens than the {len(grids)} image grid(s)")
        t, h, w = grid[0], grid[1] // merge, grid[2] // merge
        end = i + t * h * w
        if end > len(ids) or (ids[i:end] != image_token_id).any():
            raise ValueError(f"image at token {i}: its grid {tuple(grid)} wants {t * h * w} image tokens there")
        out[:, i:end] = np.stack(np.meshgrid(np.arange(t), np.arange(h), np.arange(w), indexing="ij")).reshape(3, -1)
        out[:, i:end] += pos
        pos, i = pos + max(h, w), end
    if next(images, None) is not None:
        raise ValueError(f"{len(grids)} image grid(s), but fewer runs of image tokens in the prompt")
    delta = int(out.max()) + 1 - len(ids) if len(ids) else 0
    return out, delta


# -- The vision tower ----------------------------------------------------------------------


class VisionTransformer(nn.Module):
    """HF's module names (checkpoints load as stored), `patch_embed.proj` a Linear."""

    def __init__(self, v: dict) -> None:
        super().__init__()
        self.config, self.merge = v, v["spatial_merge_size"]
        self.head_dim = v["hidden_size"] // v["num_heads"]
        # merged tokens per window side: window_size pixels / patch pixels / m patches
        self.window = v["window_size"] // self.merge // v["patch_size"]
        self.full_blocks = set(v["fullatt_block_indexes"])
        width = v["in_channels"] * v["temporal_patch_size"] * v["patch_size"] ** 2
        self.patch_embed = nn.ModuleDict({"proj": nn.Linear(width, v["hidden_size"], bias=False)})
        self.blocks = nn.ModuleList(VisionBlock(v["hidden_size"], v["num_heads"], v["intermediate_size"])
                                    for _ in range(v["depth"]))
        self.merger = PatchMerger(v["hidden_size"], v["out_hidden_size"], self.merge ** 2)

    def forward(self, pixels: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        """Patch rows [N, width] of the images, one after another -> [N / m^2, out_hidden]."""
        unit, device = self.merge ** 2, pixels.device
        order, window_lens = window_order(grids, self.merge, self.window)  # merged tokens, window by window
        rows = (order[:, None] * unit + torch.arange(unit)).flatten()  # their patch rows
        proj = self.patch_embed["proj"]
        x = proj(pixels.to(proj.weight.dtype))[rows.to(device)]
        rope = axial_rope(patch_positions(grids, self.merge)[rows].to(device), self.head_dim,
                          self.config["rope_theta"])
        frames = [h * w for t, h, w in grids for _ in range(t)]
        full, windows = segment_groups(frames, device), segment_groups(window_lens, device)
        for i, block in enumerate(self.blocks):
            x = block(x, rope, full if i in self.full_blocks else windows)
        return self.merger(x)[torch.argsort(order).to(device)]


def axial_rope(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 cos, sin [N, 1, head_dim] for (row, column) patch positions [N, 2]: a quarter of
    the head's pairs turn with the row, a quarter with the column, as HF's axial rope."""
    half = head_dim // 2
    inv_freq = 1.0 / (theta ** (torch.arange(0, half, 2, dtype=torch.float) / half))
    freqs = (positions[..., None].float() * inv_freq.to(positions.device)).flatten(1)  # [N, (row, col) freqs]
    emb = torch.cat([freqs, freqs], dim=-1)[:, None]
    return emb.cos(), emb.sin()


class VisionBlock(Layer):
    def __init__(self, dim: int, num_heads: int, intermediate_size: int) -> None:
        super().__init__()
        self.norm1 = RMSNorm(dim, VISION_EPS)
        self.norm2 = RMSNorm(dim, VISION_EPS)
        self.attn = VisionAttention(dim, num_heads)
        self.mlp = VisionMLP(dim, intermediate_size)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], segments: list[torch.Tensor]
                ) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), rope, segments)
        return x + self.mlp(self.norm2(x))


class VisionAttention(Layer):
    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], segments: list[torch.Tensor]
                ) -> torch.Tensor:
        """Full attention within each segment of rows; `segments`: [B, L] row indices of B
        segments of L rows each (one SDPA call per length)."""
        n = x.shape[0]
        q, k, v = self.qkv(x).view(n, 3, self.num_heads, -1).unbind(1)
        q, k = (apply_rotary(t.float(), *rope).to(x.dtype) for t in (q, k))  # fp32 rotation, as HF
        out = torch.empty_like(q)
        for index in segments:
            qs, ks, vs = (t[index].transpose(1, 2) for t in (q, k, v))  # [B, heads, L, head_dim]
            out[index] = F.scaled_dot_product_attention(qs, ks, vs).transpose(1, 2)
        return self.proj(out.reshape(n, -1))


class VisionMLP(Layer):
    def __init__(self, dim: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, intermediate_size)
        self.up_proj = nn.Linear(dim, intermediate_size)
        self.down_proj = nn.Linear(intermediate_size, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class PatchMerger(Layer):
    def __init__(self, dim: int, out_dim: int, unit: int) -> None:
        super().__init__()
        self.width = dim * unit
        self.ln_q = RMSNorm(dim, VISION_EPS)
        self.mlp = nn.Sequential(nn.Linear(self.width, self.width), nn.GELU(), nn.Linear(self.width, out_dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.width))


def window_order(grids: list[tuple[int, int, int]], merge: int, window: int) -> tuple[torch.Tensor, list[int]]:
    """(merged-token indices of all images, window by window; each window's patch rows), as
    HF's get_vision_window_index: per frame, windows of window x window merged tokens from the
    top left (the last row and column of windows cut short), tokens row-major inside each."""
    order, lens, first = [], [], 0
    for t, h, w in grids:
        rows, cols = h // merge, w // merge
        index = torch.arange(first, first + t * rows * cols).view(t, rows, cols)
        for frame in index:
            for r in range(0, rows, window):
                for c in range(0, cols, window):
                    cell = frame[r:r + window, c:c + window].flatten()
                    order.append(cell)
                    lens.append(cell.numel() * merge * merge)
        first += t * rows * cols
    return torch.cat(order), lens


def patch_positions(grids: list[tuple[int, int, int]], merge: int) -> torch.Tensor:
    """[N, 2] (row, column) of every patch row, in the processor's (t, h/m, w/m, m, m) order."""
    out = []
    for t, h, w in grids:
        row = torch.arange(h)[:, None].expand(h, w)
        col = torch.arange(w)[None, :].expand(h, w)
        blocked = [p.reshape(h // merge, merge, w // merge, merge).transpose(1, 2).flatten() for p in (row, col)]
        out.append(torch.stack(blocked, dim=-1).repeat(t, 1))
    return torch.cat(out)


def segment_groups(lengths: list[int], device: torch.device) -> list[torch.Tensor]:
    """Consecutive runs of rows of these lengths, grouped by length: [B, L] row indices each."""
    starts = np.cumsum([0, *lengths[:-1]])
    by_length: dict[int, list[int]] = {}
    for start, length in zip(starts.tolist(), lengths):
        by_length.setdefault(length, []).append(start)
    return [(torch.tensor(s)[:, None] + torch.arange(n)).to(device) for n, s in by_length.items()]
