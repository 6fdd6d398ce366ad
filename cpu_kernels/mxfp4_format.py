"""MXFP4 (OCP Microscaling FP4), as gpt-oss ships its experts: blocks of 32 values, each an
e2m1 nibble (sign, 2 exponent bits, 1 mantissa bit), sharing one e8m0 scale (a power of two,
2^(byte - 127)):

    *_blocks  uint8 [..., rows, K / 32, 16]: byte j of a block holds value 2j in its low
              nibble and value 2j + 1 in its high one
    *_scales  uint8 [..., rows, K / 32]

    w = E2M1[nibble] * 2^(scale - 127),   E2M1 = 0, 0.5, 1, 1.5, 2, 3, 4, 6, then negated

Every such product has at most two significant bits, so it is exact in float32 and bfloat16
(transformers' `convert_moe_packed_tensors` computes the same values).
"""

from __future__ import annotations

import torch

BLOCK = 32
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
SCALE_BIAS = 127


def check(blocks: torch.Tensor, scales: torch.Tensor, name: str) -> None:
    """A ValueError naming `name` unless blocks [..., G, 16] and scales [..., G] are uint8 and agree."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 {name}: blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.dim() < 2 or blocks.shape[-1] != BLOCK // 2 or blocks.shape[:-1] != scales.shape:
        raise ValueError(f"MXFP4 {name}: blocks {list(blocks.shape)} and scales {list(scales.shape)} do not fit "
                         f"(want blocks [..., G, {BLOCK // 2}] and scales [..., G])")


def quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., K] (K a multiple of 32) in MXFP4 by the OCP Microscaling rules: per block of 32,
    the scale exponent floor(log2(amax)) - 2 (e2m1's largest exponent; -127 for a block of
    zeros), each value rounded to the nearest e2m1 magnitude (clamped to 6) with its sign.
    (blocks uint8 [..., K/32, 16], scales uint8 [..., K/32]) in the checkpoints' layout."""
    grid = torch.tensor(E2M1[:8])
    blocks = w.float().reshape(*w.shape[:-1], -1, BLOCK)
    amax = blocks.abs().amax(-1, keepdim=True)
    exponent = torch.where(amax > 0, torch.floor(torch.log2(amax)) - 2, torch.full_like(amax, -127)).clamp(-127, 127)
    scaled = (blocks / torch.ldexp(torch.ones_like(exponent), exponent.int())).clamp(-6, 6)
    index = (scaled.abs().unsqueeze(-1) - grid).abs().argmin(-1)  # the nearest magnitude
    codes = (index | ((scaled < 0).long() << 3)).to(torch.uint8)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return packed.contiguous(), (exponent.squeeze(-1) + SCALE_BIAS).to(torch.uint8)


def dequantize(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """float32 [..., G * 32]: each block's values times its scale, exactly."""
    check(blocks, scales, "tensor")
    lut = torch.tensor(E2M1, dtype=torch.float32)
    values = torch.stack([lut[(blocks & 15).long()], lut[(blocks >> 4).long()]], dim=-1).flatten(-2)  # [..., G, 32]
    exponents = scales.to(torch.int32) - SCALE_BIAS
    return torch.ldexp(values, exponents.unsqueeze(-1)).flatten(-2)
