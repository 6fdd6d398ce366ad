"""int4 weights for the integer W4A8 kernel (csrc/int4_int8.cpp), and its reference.

The weights are the int4 blocks of cpu_kernels/quant_format.py (w = scale * q + zero, q in
0..15, float32 scale and zero per 32 values along K: GGUF Q4_0/Q4_1, Q4_K re-blocked,
GPTQ/AWQ). The activations are rounded to 8 bits per block of 32 (GGUF's Q8_0 blocks), the
products summed exactly in int32, and the float part runs in one fixed order per output.
`reference` computes that order in plain torch, so the kernel is checked bitwise.

Packed layout, one record per group of 16 columns and block of 32 k (G = ceil(N / 16), the
last group padded with zero columns; records group-major, then block):

    record (g, b):  chunk h = 0..3, 64 bytes: byte 4c + t: low nibble  = q[16g + c, 32b + 4h + t]
                                                           high nibble = q[16g + c, 32b + 16 + 4h + t]
                    | scales [16] (column 16g + c) | zeros [16], by the encoding:
       fp32   float32 scale and zero                                     384 bytes, 6 bits a weight
       fp16   fp16 scale and zero (exact: GGUF's blocks)                 320 bytes, 5 bits a weight
       units  fp16 scale and u, zero = scale * u exactly (GPTQ, AWQ)     320 bytes

Each encoding gives the kernel the same float32 scales and zeros, so the same bits; `pack`
picks the smallest that holds the weight exactly (packing.zero_encoding's test).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cpu_kernels.packing import zero_encoding
from cpu_kernels.quant_format import BLOCK, QuantizedTensor, unpack_int4

GROUP = 16  # columns per VPDPBUSD operand
NIBBLE_BYTES = 4 * 64
ENCODINGS = ("fp32", "fp16", "units")  # the kernel's numbering


@dataclass
class PackedInt4Int8:
    """An [n, k] int4 weight in the integer kernel's layout, flat in `data`."""

    data: torch.Tensor  # uint8 [ceil(n / 16) * k / 32 * record_bytes(encoding)]
    n: int
    k: int
    encoding: str  # "fp32" | "fp16" | "units": how each record holds its scales and zeros


def record_bytes(encoding: str) -> int:
    return NIBBLE_BYTES + 2 * GROUP * (4 if encoding == "fp32" else 2)


def check(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> None:
    """A ValueError unless qweight uint8 [N, K/2] and scales, zeros float32 [N, K/32] agree."""
    n = qweight.shape[0] if qweight.dim() == 2 else -1
    want = (n, qweight.shape[-1] * 2 // BLOCK)
    if (qweight.dtype != torch.uint8 or qweight.dim() != 2 or qweight.shape[1] % (BLOCK // 2)
            or any(t.dtype != torch.float32 or tuple(t.shape) != want for t in (scales, zeros))):
        raise ValueError(f"int4 weight: want qweight uint8 [N, K/2] (K a multiple of {BLOCK}) and float32 scales, "
                         f"zeros [N, K/32]; got {qweight.dtype} {tuple(qweight.shape)}, {scales.dtype} "
                         f"{tuple(scales.shape)}, {zeros.dtype} {tuple(zeros.shape)}")


def pack(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, encoding: str | None = None
         ) -> PackedInt4Int8:
    """An int4 weight (qweight uint8 [N, K/2] in GGUF's nibble order, scales and zeros float32
    [N, K/32]) in the kernel's layout. `encoding`: of the scales and zeros (default: fp16 or
    units where exact, else fp32); a ValueError if the one asked for is not exact."""
    check(qweight, scales, zeros)
    exact = zero_encoding(QuantizedTensor("int4", qweight, scales, zeros))
    encoding = encoding or exact or "fp32"
    if encoding not in ENCODINGS or (encoding != "fp32" and encoding != exact):
        raise ValueError(f"encoding {encoding!r} does not hold these scales and zeros exactly "
                         f"(this weight: {exact or 'fp32'})")
    if encoding == "units":
        zeros = torch.where(scales != 0, zeros / scales, torch.zeros_like(zeros)).round()
    half = torch.float32 if encoding == "fp32" else torch.float16
    n, blocks = scales.shape
    groups = -(-n // GROUP)
    pad = groups * GROUP - n
    values = unpack_int4(qweight)  # [N, K], k in order
    values = torch.cat([values, values.new_zeros(pad, values.shape[1])])
    # [g, col, b, half, h, t] -> [g, b, h, col, t, half]: k = 32b + 16 half + 4h + t
    v = values.view(groups, GROUP, blocks, 2, 4, 4).permute(0, 2, 4, 1, 5, 3)
    nibbles = (v[..., 0] | (v[..., 1] << 4)).reshape(groups, blocks, -1)  # [g, b, 256]

    def columns(part: torch.Tensor) -> torch.Tensor:  # [N, K/32] -> [g, b, 16 values] as bytes
        part = torch.cat([part, part.new_zeros(pad, blocks)]).to(half)
        return part.view(groups, GROUP, blocks).transpose(1, 2).contiguous().view(torch.uint8)

    data = torch.cat([nibbles, columns(scales), columns(zeros)], dim=-1).reshape(-1).contiguous()
    return PackedInt4Int8(data, n, blocks * BLOCK, encoding)


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [M, K] -> (q float32 [M, K/32, 32] integers in -127..127, d, e float32 [M, K/32]):
    d = amax / 127, q = round(x * (1 / d)) (half to even; d = 0 gives 0), e = sum(q) * d,
    each a float32 operation as the kernel does it."""
    xb = x.float().view(x.shape[0], -1, BLOCK)
    amax = xb.abs().amax(-1)
    d = amax / torch.full_like(amax, 127.0)
    inv = torch.where(d != 0, torch.ones_like(d) / d, torch.zeros_like(d))
    q = torch.round(xb * inv[..., None]).clamp(-127, 127)
    return q, d, q.sum(-1) * d  # the integer sum is exact in float32 (|sum| <= 4064)


def reference(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
    """The kernel's bits in plain torch: x [M, K] bfloat16 or float32 -> [M, N] of x's dtype. Per block b in
    order, acc = acc + float(s) * (scale * d), then acc = acc + zero * e, every operation a
    separately rounded float32 one (s the exact integer dot product of the nibbles and q)."""
    check(qweight, scales, zeros)
    q, d, e = quantize_activations(x)
    n, blocks = scales.shape
    w = unpack_int4(qweight).view(n, blocks, BLOCK).double()
    s = torch.einsum("mbk,nbk->mnb", q.double(), w).float()  # exact: integers below 2^24
    acc = torch.zeros(x.shape[0], n)
    for b in range(blocks):
        acc = acc + s[..., b] * (scales[None, :, b] * d[:, b, None])
        acc = acc + zeros[None, :, b] * e[:, b, None]
    return acc.to(x.dtype)
