"""Rotary position embeddings (rotate-half layout, as HF stores Llama weights).

The cos/sin table is computed once for every position up to the model's
length, in fp32, the same way HF computes it on the fly, so results match.
Supported scalings: default, linear, llama3, longrope (Phi-3; see `longrope_params`), yarn
(gpt-oss; `yarn_params`). Qwen2-VL's M-RoPE (three positions per token) reads the same table:
`MRotaryEmbedding`.

Each step the model asks the embedding once for a `Rope` (this step's positions), which
every layer then applies to its q and k heads: in place through the fused op of
`kernels` where it is set (cpu_kernels.ops or cupy_kernels.ops, by
engine.models.loader.use_layer_kernels), else in plain torch from cos/sin gathered once per step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn


def compute_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    rope_type = (scaling or {}).get("rope_type") or (scaling or {}).get("type") or "default"
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / scaling["factor"]
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    raise ValueError(f"rope scaling {rope_type!r} is not supported (supported: default, linear, llama3, longrope, "
                     "yarn)")


def rope_tables_params(head_dim: int, theta: float, scaling: dict | None, max_positions: int
                       ) -> tuple[torch.Tensor, float]:
    """(inv_freq, factor cos and sin are multiplied by) for a table of `max_positions`."""
    rope_type = (scaling or {}).get("rope_type") or (scaling or {}).get("type")
    if rope_type == "longrope":
        return longrope_params(head_dim, theta, scaling, max_positions)
    if rope_type == "yarn":
        return yarn_params(head_dim, theta, scaling)
    return compute_inv_freq(head_dim, theta, scaling), 1.0


def yarn_params(head_dim: int, theta: float, s: dict) -> tuple[torch.Tensor, float]:
    """YaRN, as transformers' `_compute_yarn_parameters`: each frequency blended between itself
    (extrapolation, the fast ones) and itself / factor (interpolation, the slow ones) by a
    linear ramp over the dimensions whose wavelengths fall between beta_fast and beta_slow
    rotations of the original context; cos and sin scaled by 0.1 ln(factor) + 1 (or the
    config's attention_factor, or DeepSeek's mscale ratio)."""
    factor, original = s["factor"], s["original_max_position_embeddings"]
    attention_factor = s.get("attention_factor")
    if attention_factor is None:
        def mscale(scale: float, m: float = 1.0) -> float:
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0
        if s.get("mscale") and s.get("mscale_all_dim"):
            attention_factor = mscale(factor, s["mscale"]) / mscale(factor, s["mscale_all_dim"])
        else:
            attention_factor = mscale(factor)

    def dim_of(rotations: float) -> float:  # the dimension that turns `rotations` times over `original`
        return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))
    low, high = dim_of(s.get("beta_fast") or 32), dim_of(s.get("beta_slow") or 1)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention_factor)


def longrope_params(head_dim: int, theta: float, s: dict, max_positions: int) -> tuple[torch.Tensor, float]:
    """LongRoPE (Phi-3), as transformers' `_compute_longrope_parameters`: per-frequency
    divisors `short_factor` or `long_factor`, and cos/sin scaled by `attention_factor`
    (default sqrt(1 + ln(factor) / ln(original_max_position_embeddings)), factor being
    max_position_embeddings / original_max_position_embeddings; both regimes get it).

    HF picks the long factors when the sequence is longer than the original length, and
    then recomputes the whole KV cache with them. A paged cache shared between requests
    cannot be re-rotated per request, so the choice here is per engine: the long factors
    when the engine serves more than the original length (max_model_len > original),
    else the short ones. Every request then gets the same rotation whatever it is batched
    with, and cached blocks stay valid; HF's output is matched exactly by sequences longer
    than the original length (long) or by an engine whose max_model_len is at most the
    original length (short)."""
    original = s["original_max_position_embeddings"]
    factors = s["long_factor"] if max_positions > original else s["short_factor"]
    if len(factors) != head_dim // 2:
        raise ValueError(f"longrope: {len(factors)} rope factors for head_dim {head_dim} (want {head_dim // 2})")
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (torch.tensor(factors, dtype=torch.float32) * theta ** exponent)
    attention_factor = s.get("attention_factor")
    if attention_factor is None:
        factor = s["factor"]
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return inv_freq, float(attention_factor)


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
    kernels = None  # the fused ops' module, or None: eager torch (the reference)

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict | None) -> None:
        super().__init__()
        self.head_dim, self.max_positions, self.theta, self.scaling = head_dim, max_positions, theta, scaling
        if torch.get_default_device().type == "meta":
            # Built on the meta device: the owner's init_non_persistent builds the table on the real
            # one. Computing it here would be wasted, and math on meta tensors imports torch._dynamo
            # (a second of every engine's start-up).
            self.register_buffer("cos", torch.empty(max_positions, head_dim), persistent=False)
            self.register_buffer("sin", torch.empty(max_positions, head_dim), persistent=False)
        else:
            self.build(None)

    def build(self, device: str | torch.device | None) -> None:
        """(Re)compute the fp32 cos/sin table, e.g. after the model was built on the meta device."""
        inv_freq, scale = rope_tables_params(self.head_dim, self.theta, self.scaling, self.max_positions)
        positions = torch.arange(self.max_positions, dtype=torch.float32, device=device)
        freqs = positions[:, None] * inv_freq.to(device)[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        if scale != 1.0:  # as HF: the scaled fp32 table, then cast to the model's dtype
            cos, sin = cos * scale, sin * scale
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> Rope:
        """This step's rotary inputs, shared by every layer."""
        if self.kernels is not None:
            return Rope(positions, (self.cos, self.sin), None, self.kernels)
        return Rope(positions, None, (self.cos[positions].unsqueeze(1).to(dtype),
                                      self.sin[positions].unsqueeze(1).to(dtype)))


class MRotaryEmbedding(RotaryEmbedding):
    """Qwen2-VL's multimodal rotary (M-RoPE, HF's apply_multimodal_rotary_pos_emb): a token has
    three positions (time, height, width), and the head's frequency pairs fall into three
    sections of `mrope_section` pairs, section s rotating by position s. A text token's three
    positions are equal, which is plain RoPE: given [T] positions, this is RotaryEmbedding.

    `interleaved` (Qwen3-VL): the sections' pairs alternate instead, t h w t h w ... (pair j
    turns with height where j % 3 == 1 and j < 3 * section[1], with width where j % 3 == 2 and
    j < 3 * section[2], else with time), as HF's Qwen3VLTextRotaryEmbedding."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict | None,
                 mrope_section: tuple[int, ...], interleaved: bool = False) -> None:
        if len(mrope_section) != 3 or sum(mrope_section) != head_dim // 2:
            raise ValueError(f"mrope_section {list(mrope_section)}: 3 sections of head_dim / 2 = {head_dim // 2} pairs")
        super().__init__(head_dim, max_positions, theta, scaling)
        self.sections = [*mrope_section, *mrope_section]  # the table's columns: cos(f) then again for the other half
        self.interleaved = interleaved

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> Rope:
        """`positions` [T] (plain RoPE) or [3, T] (M-RoPE)."""
        if positions.dim() == 1:
            return super().forward(positions, dtype)
        cos, sin = self._pick(self.cos, positions), self._pick(self.sin, positions)  # fp32 [T, D]
        if self.kernels is not None:  # the fused op looks rows up by position: these rows are the table
            rows = torch.arange(positions.shape[1], device=positions.device)
            return Rope(rows, (cos, sin), None, self.kernels)
        return Rope(positions[0], None, (cos.unsqueeze(1).to(dtype), sin.unsqueeze(1).to(dtype)))

    def _pick(self, table: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Each column from the row of its section's position."""
        if self.interleaved:
            rows = table[positions]  # [3, T, D]
            out, half = rows[0].clone(), self.head_dim // 2
            for axis in (1, 2):
                for first in (0, half):
                    columns = slice(first + axis, first + min(3 * self.sections[axis], half), 3)
                    out[:, columns] = rows[axis][:, columns]
            return out
        parts = table[positions].split(self.sections, dim=-1)  # 6 x [3, T, cols]
        return torch.cat([part[i % 3] for i, part in enumerate(parts)], dim=-1)


@dataclass(slots=True)
class Rope:
    """One step's rotary inputs: the fp32 tables for the fused op (it looks positions up
    itself), or cos/sin [T, 1, D] in the model's dtype for the torch path."""

    positions: torch.Tensor  # [T] int64
    tables: tuple[torch.Tensor, torch.Tensor] | None
    gathered: tuple[torch.Tensor, torch.Tensor] | None
    kernels: object = None  # the module whose `rotary` takes `tables`

    def rotate(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, heads, D] (rows may be strided, as a view of the fused qkv) -> rotated. The
        fused op rotates x in place and returns it; torch returns a new tensor."""
        if self.gathered is not None:
            return apply_rotary(x, *self.gathered)
        self.kernels.rotary(x.flatten(1), self.positions, *self.tables, x.shape[1], x.shape[2])
        return x


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, D]; cos/sin: [T, 1, D]."""
    return x * cos + _rotate_half(x) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
