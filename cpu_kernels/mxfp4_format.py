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


# --- the integer kernel's layout (csrc/mxfp4_int8.cpp, --cpu-arithmetic int8) -----------------

GROUP = 16  # columns per VPDPBUSD operand
# VPDPBUSD multiplies unsigned by signed bytes: each code reads as 2 * E2M1 + 12 (0..24).
INT8_OFFSET = 12


def pack_int8(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """One MXFP4 matrix (blocks [N, K/32, 16], scales [N, K/32]) in the integer kernel's
    layout, 4.25 bits a weight (csrc/mxfp4_int8.cpp): columns in groups of 16 (the last padded
    with zero codes), per group and block four 64-byte chunks of nibbles, chunk h's byte j
    holding column j / 4 at k = 8h + j % 4 (low nibble) and k + 4 (high), then 16 e8m0 bytes."""
    check(blocks, scales, "weight")
    n, nblocks = scales.shape
    groups = -(-n // GROUP)
    codes = torch.stack([blocks & 15, blocks >> 4], dim=-1).reshape(n, nblocks, BLOCK)  # k in order
    codes = torch.cat([codes, codes.new_zeros(groups * GROUP - n, nblocks, BLOCK)])
    e8m0 = torch.cat([scales, scales.new_zeros(groups * GROUP - n, nblocks)])
    # [G, col, b, h, half, t] -> [G, b, h, col, t, half]: k = 8h + 4 half + t
    codes = codes.view(groups, GROUP, nblocks, 4, 2, 4).permute(0, 2, 3, 1, 5, 4)
    nibbles = codes[..., 0] | (codes[..., 1] << 4)  # [G, b, h, col, t]
    e8m0 = e8m0.view(groups, GROUP, nblocks).permute(0, 2, 1)
    return torch.cat([nibbles.reshape(-1), e8m0.reshape(-1)]).contiguous()


def int8_linear_reference(x: torch.Tensor, blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """float64 [M, N]: what csrc/mxfp4_int8.cpp computes before its float32 roundings: x
    (bfloat16) rounded per block of 32 to 8 bits as its top says (in float32, RNE), times the
    weights' exact values."""
    xb = x.float().view(x.shape[0], -1, BLOCK)
    d = xb.abs().amax(-1, keepdim=True) / 127
    inv = torch.where(d != 0, 1 / d, torch.zeros_like(d))
    q = torch.round(xb * inv).clamp(-127, 127)
    activations = (q.double() * d.double()).flatten(1)
    return activations @ dequantize(blocks, scales).double().t()
