"""Rotary position embeddings (rotate-half layout, as HF stores Llama weights).

The cos/sin table is computed once for every position up to the model's
length, in fp32, the same way HF computes it on the fly, so results match.
Supported scalings: default, linear, llama3.

Each step the model asks the embedding once for a `Rope` (this step's positions), which
every layer then applies to its q and k heads: in place through cpu_kernels' fused op
where `use_kernel` is set (engine.models.loader.use_layer_kernels), else in plain torch
from cos/sin gathered once per step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from cpu_kernels import ops


def compute_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    rope_type = (scaling or {}).get("rope_type") or (scaling or {}).get("type") or "default"
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / scaling["factor"]
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    raise ValueError(f"rope scaling {rope_type!r} is not supported (supported: default, linear, llama3)")


def _llama3_inv_freq(inv_freq: torch.Tensor, s: dict) -> torch.Tensor:
    # Llama 3.1: keep high frequencies, divide low ones by `factor`, blend between.
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    use_kernel = False

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict | None) -> None:
        super().__init__()
        self.head_dim, self.max_positions, self.theta, self.scaling = head_dim, max_positions, theta, scaling
        self.build(None)

    def build(self, device: str | torch.device | None) -> None:
        """(Re)compute the fp32 cos/sin table, e.g. after the model was built on the meta device."""
        inv_freq = compute_inv_freq(self.head_dim, self.theta, self.scaling).to(device)
        positions = torch.arange(self.max_positions, dtype=torch.float32, device=device)
        freqs = positions[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> Rope:
        """This step's rotary inputs, shared by every layer."""
        if self.use_kernel:
            return Rope(positions, (self.cos, self.sin), None)
        return Rope(positions, None, (self.cos[positions].unsqueeze(1).to(dtype),
                                      self.sin[positions].unsqueeze(1).to(dtype)))


@dataclass(slots=True)
class Rope:
    """One step's rotary inputs: the fp32 tables for the fused op (it looks positions up
    itself), or cos/sin [T, 1, D] in the model's dtype for the torch path."""

    positions: torch.Tensor  # [T] int64
    tables: tuple[torch.Tensor, torch.Tensor] | None
    gathered: tuple[torch.Tensor, torch.Tensor] | None

    def rotate(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, heads, D] (rows may be strided, as a view of the fused qkv) -> rotated. The
        fused op rotates x in place and returns it; torch returns a new tensor."""
        if self.gathered is not None:
            return apply_rotary(x, *self.gathered)
        ops.rotary(x.flatten(1), self.positions, *self.tables, x.shape[1], x.shape[2])
        return x


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, D]; cos/sin: [T, 1, D]."""
    return x * cos + _rotate_half(x) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
