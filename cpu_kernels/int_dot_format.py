"""int4 and int8 weights for the integer kernels (csrc/int_dot.cpp: W4A8, W8A8), and their reference.

The weights are the blocks of cpu_kernels/quant_format.py, 32 values along K a block:
  int4: w = scale * q + zero, q in 0..15 (GGUF Q4_0/Q4_1, Q4_K re-blocked, GPTQ/AWQ)
  int8: w = scale * q, q in -128..127    (GGUF Q8_0, --quantization int8)
The activations are rounded to 8 bits per block of 32 (GGUF's Q8_0 blocks), the products
summed exactly in int32, and the float part runs in one fixed order per output. `reference`
computes that order in plain torch, so the kernels are checked bitwise.

Packed layout, one record per group of 16 columns and block of 32 k (G = ceil(N / 16), the
last group padded with zero columns; records group-major, then block):

    int4 record (g, b):  chunk h = 0..3, 64 bytes: byte 4c + t: low nibble  = q[16g + c, 32b + 4h + t]
                                                               high nibble = q[16g + c, 32b + 16 + 4h + t]
                         | scales [16] (column 16g + c) | zeros [16], by the encoding:
       fp32   float32 scale and zero                                     384 bytes, 6 bits a weight
       fp16   fp16 scale and zero (exact: GGUF's blocks)                 320 bytes, 5 bits a weight
       units  fp16 scale and u, zero = scale * u exactly (GPTQ, AWQ)     320 bytes
    int8 record (g, b):  chunk h = 0..7, 64 bytes: byte 4c + t = q[16g + c, 32b + 4h + t] + 128
                         | scales [16]: fp32 (576 bytes) or fp16 (544: GGUF Q8_0's 8.5 bits)

Each encoding gives the kernel the same float32 scales and zeros, so the same bits; `pack`
picks the smallest that holds the weight exactly (packing.zero_encoding's test for int4).
`rows` reads rows back from the packed bytes (a tied embedding's lookup).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cpu_kernels.packing import zero_encoding
from cpu_kernels.quant_format import BLOCK, QuantizedTensor, pack_int4, unpack_int4

GROUP = 16  # columns per VPDPBUSD operand
CHUNK = 64
CHUNKS = {"int4": 4, "int8": 8}  # 64-byte chunks of values in a record
ENCODINGS = ("fp32", "fp16", "units")  # the kernel's numbering


@dataclass
class PackedIntDot:
    """An [n, k] int4 or int8 weight in the integer kernels' layout, flat in `data`."""

    data: torch.Tensor  # uint8 [ceil(n / 16) * k / 32 * record_bytes(fmt, encoding)]
    fmt: str  # "int4" | "int8"
    n: int
    k: int
    encoding: str  # "fp32" | "fp16" | "units" (int4 only): how each record holds its scales (and zeros)

    @property
    def shape(self) -> tuple[int, int]:
        return self.n, self.k


def record_bytes(fmt: str, encoding: str) -> int:
    parts = 2 if fmt == "int4" else 1
    return CHUNKS[fmt] * CHUNK + parts * GROUP * (4 if encoding == "fp32" else 2)


def check(weight: QuantizedTensor) -> None:
    """A ValueError unless `weight` is int4 or int8 in blocks of 32 along K (no act-order)."""
    if weight.format not in CHUNKS or weight.perm is not None:
        raise ValueError(f"the integer kernels take int4 or int8 blocks in input order; got {weight.format}"
                         f"{' with an act-order permutation' if weight.perm is not None else ''}")
    n, k = weight.shape
    if k % BLOCK or tuple(weight.scales.shape) != (n, k // BLOCK) or weight.scales.dtype != torch.float32:
        raise ValueError(f"{weight.format} weight: want K a multiple of {BLOCK} and float32 scales [N, K/32]; got "
                         f"[{n}, {k}] with scales {weight.scales.dtype} {tuple(weight.scales.shape)}")


def exact_encoding(weight: QuantizedTensor) -> str:
    """The smallest encoding that holds `weight`'s scales (and zeros) exactly."""
    if weight.format == "int4":
        return zero_encoding(weight) or "fp32"
    return "fp16" if torch.equal(weight.scales.half().float(), weight.scales) else "fp32"


def pack(weight: QuantizedTensor, encoding: str | None = None) -> PackedIntDot:
    """`weight` in the kernels' layout. `encoding`: of the scales and zeros (default: the
    smallest exact one); a ValueError if the one asked for is not exact."""
    check(weight)
    exact = exact_encoding(weight)
    encoding = encoding or exact
    if encoding not in ENCODINGS or (encoding != "fp32" and encoding != exact):
        raise ValueError(f"encoding {encoding!r} does not hold these scales and zeros exactly (this weight: {exact})")
    n, k = weight.shape
    blocks, groups = k // BLOCK, -(-n // GROUP)
    pad = groups * GROUP - n

    def columns(part: torch.Tensor) -> torch.Tensor:  # [N, K/32] -> [g, b, 16 values] as bytes
        part = torch.cat([part, part.new_zeros(pad, blocks)]).to(torch.float32 if encoding == "fp32" else torch.float16)
        return part.view(groups, GROUP, blocks).transpose(1, 2).contiguous().view(torch.uint8)

    if weight.format == "int4":
        values = unpack_int4(weight.qweight)  # [N, K], k in order
        values = torch.cat([values, values.new_zeros(pad, k)])
        # [g, col, b, half, h, t] -> [g, b, h, col, t, half]: k = 32b + 16 half + 4h + t
        v = values.view(groups, GROUP, blocks, 2, 4, 4).permute(0, 2, 4, 1, 5, 3)
        chunks = (v[..., 0] | (v[..., 1] << 4)).reshape(groups, blocks, -1)  # [g, b, 256]
        zeros = weight.zeros
        if encoding == "units":
            zeros = torch.where(weight.scales != 0, zeros / weight.scales, torch.zeros_like(zeros)).round()
        parts = [chunks, columns(weight.scales), columns(zeros)]
    else:
        values = (weight.qweight.to(torch.int16) + 128).to(torch.uint8)
        values = torch.cat([values, values.new_full((pad, k), 128)])  # padding: q = 0
        # [g, col, b, h, t] -> [g, b, h, col, t]: k = 32b + 4h + t
        chunks = values.view(groups, GROUP, blocks, 8, 4).permute(0, 2, 3, 1, 4).reshape(groups, blocks, -1)
        parts = [chunks, columns(weight.scales)]
    data = torch.cat(parts, dim=-1).reshape(-1).contiguous()
    return PackedIntDot(data, weight.format, n, k, encoding)


def rows(packed: PackedIntDot, ids: torch.Tensor) -> QuantizedTensor:
    """Rows `ids` of the weight, read back from the packed bytes in the row layout."""
    ids = ids.flatten().long()
    blocks, groups = packed.k // BLOCK, -(-packed.n // GROUP)
    records = packed.data.view(groups, blocks, -1)[ids // GROUP]  # [T, b, bytes]
    col = (ids % GROUP)[:, None, None]
    half = torch.float32 if packed.encoding == "fp32" else torch.float16
    value_bytes = GROUP * (4 if packed.encoding == "fp32" else 2)
    values_end = CHUNKS[packed.fmt] * CHUNK

    def column_values(start: int) -> torch.Tensor:  # [T, b] float32 of each row's column
        part = records[..., start:start + value_bytes].contiguous().view(half).float()
        return part.gather(-1, col.expand(-1, blocks, 1)).squeeze(-1)

    scales = column_values(values_end)
    t = len(ids)
    if packed.fmt == "int8":
        q = records[..., :values_end].view(t, blocks, 8, GROUP, 4)
        q = q.gather(3, col[..., None, None].expand(-1, blocks, 8, 1, 4)).reshape(t, packed.k)
        return QuantizedTensor("int8", (q.to(torch.int16) - 128).to(torch.int8), scales, None)
    nibbles = records[..., :values_end].view(t, blocks, 4, GROUP, 4)
    nibbles = nibbles.gather(3, col[..., None, None].expand(-1, blocks, 4, 1, 4)).view(t, blocks, 16)  # k = 4h + t
    values = torch.cat([nibbles & 0xF, nibbles >> 4], dim=-1).view(t, packed.k)
    zeros = column_values(values_end + value_bytes)
    if packed.encoding == "units":
        zeros = scales * zeros
    return QuantizedTensor("int4", pack_int4(values), scales, zeros)


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


def reference(x: torch.Tensor, weight: QuantizedTensor) -> torch.Tensor:
    """The kernels' bits in plain torch: x [M, K] bfloat16 or float32 -> [M, N] of x's dtype. Per block b in
    order, acc = acc + float(s) * (scale * d), then (int4) acc = acc + zero * e, every operation a
    separately rounded float32 one (s the exact integer dot product of the weight's q and the 8-bit x)."""
    check(weight)
    q, d, e = quantize_activations(x)
    n, k = weight.shape
    blocks = k // BLOCK
    w = unpack_int4(weight.qweight) if weight.format == "int4" else weight.qweight
    s = torch.einsum("mbk,nbk->mnb", q.double(), w.view(n, blocks, BLOCK).double()).float()  # exact: below 2^24
    acc = torch.zeros(x.shape[0], n)
    for b in range(blocks):
        acc = acc + s[..., b] * (weight.scales[None, :, b] * d[:, b, None])
        if weight.format == "int4":
            acc = acc + weight.zeros[None, :, b] * e[:, b, None]
    return acc.to(x.dtype)
