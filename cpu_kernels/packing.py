"""Weight layouts for the bf16 quantized kernels (csrc/quant_linear_bf16.cpp), and back.

GGUF keeps a weight row by row, a block of 32 k at a time. VDPBF16PS wants one vector to
hold 16 columns x 2 consecutive k, so that lanes are output columns and no horizontal sum
is needed. Columns go in groups of 16 (G = ceil(N / 16), the last padded with zeros):

    int4 quad t of block b, 32 bytes:  byte i: low nibble  = q[16g + i/2, 32b + 4t + i%2]
                                               high nibble = q[16g + i/2, 32b + 4t + 2 + i%2]
    int8 pair p of block b, 32 bytes:  byte i = q[16g + i/2, 32b + 2p + i%2]

A decode tile works on 8 groups at once, vector by vector, so groups go in super-groups of
8 (the last may be narrower, width w) interleaved at that grain, and a tile reads one
sequential stream:

    super-group, block b:  int4: quad 0 of its w groups, ..., quad 7 | w x 16 fp16 scales | w x 16 fp16 zeros
                           int8: pair 0 of its w groups, ..., pair 15 | w x 16 fp32 scales
    (block 0, then block 1, ...; super-group after super-group)

int4 scales and zeros are stored as fp16, exactly as GGUF's Q4_0/Q4_1 store them (and as
`quantize` rounds them). A GPTQ/AWQ zero, -scale * z for an integer z, has up to 15
significant bits, which fp16 cannot hold: such a layer stores -z instead (`zero_units`), and
the kernels multiply it by the scale in fp32, exactly (see `zero_encoding`). `pack` refuses
what neither holds. `unpack` is the exact inverse, and `unpack_rows` reads a few rows (an
embedding lookup) without unpacking the rest.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cpu_kernels.quant_format import BLOCK, NIBBLE_FORMATS, QuantizedTensor, pack_int4, unpack_int4

GROUP = 16  # columns per vector
SUPER_GROUP = 8  # groups interleaved vector by vector
VECTORS = {"int4": 8, "fp4": 8, "int8": 16}  # weight vectors per group and block


@dataclass
class PackedWeight:
    """An [n, k] weight in the bf16 kernels' layout, flat in `data`."""

    format: str  # "int4" | "int8" | "fp4" (int4's layout, e2m1 codes)
    data: torch.Tensor  # uint8 [ceil(n / 16) * k/32 * (32 * vectors + 64)]
    n: int
    k: int
    zero_units: bool = False  # int4: zeros stored as multiples of the scale (see zero_encoding)


def zero_encoding(weight: QuantizedTensor) -> str | None:
    """How the bf16 kernels hold an int4 weight's float32 scales and zeros exactly: "fp16"
    (both are fp16 values: GGUF), "units" (the scales are, and each zero is the scale times an
    integer -15..0, exact in fp32: GPTQ and AWQ), or None (neither: the float32 kernels run it).
    int8 weights (fp32 scales, no zeros) are always "fp16"."""
    if weight.format not in NIBBLE_FORMATS:
        return "fp16"
    scales, zeros = weight.scales, weight.zeros
    if not torch.equal(scales.half().float(), scales):
        return None
    if torch.equal(zeros.half().float(), zeros):
        return "fp16"
    units = torch.where(scales != 0, zeros / scales, torch.zeros_like(zeros)).round()
    if bool(((units < -15) | (units > 0)).any()) or not torch.equal(units * scales, zeros):
        return None
    return "units"


def pack(weight: QuantizedTensor, encoding: str | None = None) -> PackedWeight:
    """`encoding`: of the int4 zeros, "fp16" or "units" (default: `zero_encoding`'s choice;
    where both hold a weight exactly, the kernels give the same bits with either)."""
    n, k = weight.shape
    groups, blocks = -(-n // GROUP), k // BLOCK
    encoding = encoding or zero_encoding(weight)
    if encoding is None:
        raise ValueError("int4 scales and zeros must be exact in fp16, as GGUF stores them (quantize() rounds "
                         "them), or zeros integer multiples of the scales (GPTQ, AWQ)")
    if weight.format in NIBBLE_FORMATS:
        v = _pad_rows(unpack_int4(weight.qweight), groups).view(groups, GROUP, blocks, 8, 2, 2)
        v = v.permute(0, 2, 3, 4, 1, 5).reshape(groups, blocks, 8, 2, 2 * GROUP)  # [g, b, quad, half, i]
        vectors = v[:, :, :, 0] | (v[:, :, :, 1] << 4)  # [g, b, 8, 32]
        zeros = weight.zeros
        if encoding == "units":
            zeros = torch.where(weight.scales != 0, zeros / weight.scales, torch.zeros_like(zeros)).round()
        scales = torch.cat([_fp16_columns(weight.scales, groups), _fp16_columns(zeros, groups)], -1)
    else:
        v = _pad_rows(weight.qweight, groups).view(groups, GROUP, blocks, 16, 2)
        vectors = v.permute(0, 2, 3, 1, 4).reshape(groups, blocks, 16, 32).view(torch.uint8)
        scales = _columns(weight.scales, groups).view(torch.uint8)  # [g, b, 64]
    parts = []
    for first in range(0, groups, SUPER_GROUP):
        sg = slice(first, first + SUPER_GROUP)
        w = vectors[sg].shape[0]
        # [w, b, vectors, 32] -> [b, vectors, w, 32]; scales [w, b, 64] -> [b, 2 or 1, w, 32 or 64]
        part_v = vectors[sg].permute(1, 2, 0, 3).reshape(blocks, -1)
        halves = 2 if weight.format in NIBBLE_FORMATS else 1
        part_s = scales[sg].view(w, blocks, halves, -1).permute(1, 2, 0, 3).reshape(blocks, -1)
        parts.append(torch.cat([part_v, part_s], dim=1).reshape(-1))
    return PackedWeight(weight.format, torch.cat(parts), n, k, encoding == "units")


def unpack(packed: PackedWeight) -> QuantizedTensor:
    """The row layout of a packed weight, 1,024 rows at a time (each row gathers its
    group's vectors, 16 times the row's own bytes)."""
    parts = [unpack_rows(packed, torch.arange(start, min(start + 1024, packed.n)))
             for start in range(0, packed.n, 1024)]

    def joined(name: str) -> torch.Tensor | None:
        tensors = [getattr(part, name) for part in parts]
        return None if tensors[0] is None else torch.cat(tensors)

    return QuantizedTensor(packed.format, joined("qweight"), joined("scales"), joined("zeros"))


def unpack_rows(packed: PackedWeight, rows: torch.Tensor) -> QuantizedTensor:
    """Rows `rows` of a packed weight, in the row layout: their 32-byte vectors gathered."""
    rows = rows.flatten().to(torch.long)
    groups, blocks, vectors = -(-packed.n // GROUP), packed.k // BLOCK, VECTORS[packed.format]  # fp4: int4's
    group, lane = rows // GROUP, rows % GROUP
    first = group // SUPER_GROUP * SUPER_GROUP
    width = (groups - first).clamp(max=SUPER_GROUP)
    offset = group - first
    # In 32-byte units: where each row's super-group row for block b starts.
    row_start = (first[:, None] * blocks + torch.arange(blocks)[None, :] * width[:, None]) * (vectors + 2)
    chunks = packed.data.view(-1, 32)
    vec_index = row_start[:, :, None] + torch.arange(vectors)[None, None, :] * width[:, None, None] + offset[:, None, None]
    values = chunks[vec_index]  # [rows, blocks, vectors, 32]
    scale_start = row_start + vectors * width[:, None]
    pick = torch.arange(len(rows))

    def per_lane(part: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:  # [rows, blocks, bytes] -> [rows, blocks]
        return part.contiguous().view(dtype)[pick, :, lane].float()

    if packed.format in NIBBLE_FORMATS:
        scales = chunks[scale_start + offset[:, None]]
        zeros = chunks[scale_start + width[:, None] + offset[:, None]]
        halves = torch.stack([values & 15, values >> 4], dim=3).view(len(rows), blocks, 8, 2, GROUP, 2)
        q = halves.permute(0, 4, 1, 2, 3, 5)[pick, lane].reshape(len(rows), packed.k)
        scales, zeros = per_lane(scales, torch.float16), per_lane(zeros, torch.float16)
        return QuantizedTensor(packed.format, pack_int4(q), scales, zeros * scales if packed.zero_units else zeros)
    scales = torch.cat([chunks[scale_start + 2 * offset[:, None]], chunks[scale_start + 2 * offset[:, None] + 1]], -1)
    q = values.view(torch.int8).view(len(rows), blocks, 16, GROUP, 2).permute(0, 3, 1, 2, 4)[pick, lane]
    return QuantizedTensor("int8", q.reshape(len(rows), packed.k).contiguous(), per_lane(scales, torch.float32))


def _pad_rows(t: torch.Tensor, groups: int) -> torch.Tensor:
    missing = groups * GROUP - t.shape[0]
    return torch.cat([t, t.new_zeros(missing, *t.shape[1:])]) if missing else t


def _columns(part: torch.Tensor, groups: int) -> torch.Tensor:
    """[N, K/32] per-column block values -> [G, K/32, 16]."""
    return _pad_rows(part, groups).view(groups, GROUP, -1).transpose(1, 2).contiguous()


def _fp16_columns(part: torch.Tensor, groups: int) -> torch.Tensor:
    """[N, K/32] (exact in fp16: `zero_encoding` checked) -> [G, K/32, 32] bytes of fp16."""
    return _columns(part.to(torch.float16), groups).view(torch.uint8)
