"""FP8 weights as checkpoints store them (e4m3fn, one byte a weight), and the layout of the
CPU kernel that runs them (csrc/fp8_linear.cpp), and back.

    w[n, k] = e4m3(data[n, k]) * scale        scale: float32, one of
      "tensor"   [1]                            compressed-tensors' per-tensor `weight_scale`
      "channel"  [N] or [N, 1]                  compressed-tensors' per-channel `weight_scale`
      "block"    [ceil(N / bn), ceil(K / bk)]   `quant_method: fp8` with `weight_block_size`
                                                [bn, bk] (DeepSeek-V3, Qwen3-FP8: 128 x 128),
                                                the `weight_scale_inv` tensor (a multiplier,
                                                despite its name)

Packed: columns in groups of 16 (G = ceil(N / 16), padded with zeros), K padded with zeros to
a multiple of 32 (Kp). A 64-byte unit holds a group's 16 columns x 4 consecutive k; groups
go in super-groups of 8, interleaved unit by unit:

    unit u of group g, byte 16 (c // 4) + 8 (kk // 2) + 2 (c % 4) + kk % 2 = data[16 g + c, 4 u + kk]
    super-group: unit 0 of its w <= 8 groups | unit 1 of its groups | ... | unit Kp/4 - 1 of them
    scales: float32 [G, KB, 16]: column 16 g + i's scale for k block b (of k_block k; one block
            of Kp for "tensor" and "channel")

`unpack` is the exact inverse of `pack`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

SCALE_KINDS = ("tensor", "channel", "block")
GROUP = 16  # columns per group: the kernel's vector lanes
SUPER_GROUP = 8  # groups interleaved unit by unit
K_PAD = 32  # K is padded to a multiple of this (an AMX tile's k)


@dataclass
class Fp8Weight:
    """An [N, K] weight in FP8 e4m3fn with float32 scales (see the module docstring)."""

    data: torch.Tensor  # uint8 [N, K]: float8_e4m3fn bits (a float8 tensor's .view(torch.uint8))
    scale: torch.Tensor  # float32, shaped by `kind`
    kind: str  # "tensor" | "channel" | "block"
    block: tuple[int, int] = (128, 128)  # (bn, bk): rows along N and K per scale, "block" only

    def __post_init__(self) -> None:
        if self.data.dtype == torch.float8_e4m3fn:
            self.data = self.data.view(torch.uint8)
        if self.data.dtype != torch.uint8 or self.data.dim() != 2:
            raise ValueError(f"FP8 weight: want float8_e4m3fn or uint8 [N, K], got {self.data.dtype} "
                             f"{tuple(self.data.shape)}")
        if self.kind not in SCALE_KINDS:
            raise ValueError(f"FP8 scale kind {self.kind!r} is not supported (supported: {', '.join(SCALE_KINDS)})")
        n, k = self.data.shape
        want = {"tensor": (1,), "channel": (n,), "block": (-(-n // self.block[0]), -(-k // self.block[1]))}[self.kind]
        flat = (self.scale.numel(),) if self.kind != "block" else tuple(self.scale.shape)
        if self.scale.dtype != torch.float32 or flat != want:
            raise ValueError(f"FP8 {self.kind} scale for a [{n}, {k}] weight: want float32 with shape {list(want)}"
                             f"{' (or [N, 1])' if self.kind == 'channel' else ''}, got {self.scale.dtype} "
                             f"{list(self.scale.shape)}")
        if self.kind == "block" and self.block[1] % K_PAD:
            raise ValueError(f"FP8 block size {list(self.block)}: the kernel wants K blocks in multiples of {K_PAD}")

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.data.shape)

    def column_scales(self) -> torch.Tensor:
        """float32 [N, KB]: each output column's scale per k block (KB = 1 unless "block")."""
        n, _ = self.shape
        if self.kind == "tensor":
            return self.scale.reshape(1, 1).expand(n, 1)
        if self.kind == "channel":
            return self.scale.reshape(n, 1)
        return self.scale.repeat_interleave(self.block[0], dim=0)[:n]

    def rows(self, start: int, count: int) -> Fp8Weight:
        """Output rows start..start+count, the same values and scales (block scales become
        each row's own, blocks of (1, bk): a shard need not start on a block of rows)."""
        data = self.data.narrow(0, start, count)
        if self.kind == "tensor":
            return Fp8Weight(data, self.scale, "tensor")
        if self.kind == "channel":
            return Fp8Weight(data, self.scale.reshape(-1).narrow(0, start, count), "channel")
        return Fp8Weight(data, self.column_scales().narrow(0, start, count).contiguous(), "block", (1, self.block[1]))

    def columns(self, start: int, count: int) -> Fp8Weight:
        """Input columns start..start+count; block scales need the slice on their column blocks."""
        data = self.data.narrow(1, start, count).contiguous()
        if self.kind != "block":
            return Fp8Weight(data, self.scale, self.kind)
        bk = self.block[1]
        if start % bk or (count % bk and start + count != self.shape[1]):
            raise ValueError(f"FP8 blocks of {bk} columns cannot be cut at columns {start}..{start + count}")
        return Fp8Weight(data, self.scale[:, start // bk:-(-(start + count) // bk)].contiguous(), "block", self.block)

    def dequantize(self) -> torch.Tensor:
        """The effective float32 weights: fp8 * scale, one float32 product per weight."""
        n, k = self.shape
        values = self.data.view(torch.float8_e4m3fn).float()
        if self.kind != "block":
            return values * self.column_scales()
        return values * self.column_scales().repeat_interleave(self.block[1], dim=1)[:, :k]


@dataclass
class PackedFp8:
    """An FP8 weight in the kernel's layout; `kind` and `block` let `unpack` restore it."""

    data: torch.Tensor  # uint8 [G * Kp * 16]
    scales: torch.Tensor  # float32 [G, KB, 16]
    n: int
    k: int
    k_block: int  # k per scale block: bk for "block", Kp otherwise
    kind: str
    block: tuple[int, int]


def pack(weight: Fp8Weight) -> PackedFp8:
    n, k = weight.shape
    groups, kp = -(-n // GROUP), -(-k // K_PAD) * K_PAD
    q = torch.zeros(groups * GROUP, kp, dtype=torch.uint8)
    q[:n, :k] = weight.data
    # [g, c // 4, c % 4, u, kk // 2, kk % 2] -> [g, u, c // 4, kk // 2, c % 4, kk % 2]
    units = q.view(groups, 4, 4, kp // 4, 2, 2).permute(0, 3, 1, 4, 2, 5).reshape(groups, kp // 4, 64)
    data = torch.cat([units[first:first + SUPER_GROUP].transpose(0, 1).reshape(-1)
                      for first in range(0, groups, SUPER_GROUP)])
    k_block = weight.block[1] if weight.kind == "block" else kp
    columns = torch.zeros(groups * GROUP, -(-kp // k_block))
    columns[:n] = weight.column_scales()
    scales = columns.view(groups, GROUP, -1).transpose(1, 2).contiguous()
    return PackedFp8(data, scales, n, k, k_block, weight.kind, weight.block)


def unpack(packed: PackedFp8) -> Fp8Weight:
    n, k = packed.n, packed.k
    groups, kp = -(-n // GROUP), -(-k // K_PAD) * K_PAD
    parts, offset = [], 0
    for first in range(0, groups, SUPER_GROUP):
        width = min(SUPER_GROUP, groups - first)
        part = packed.data[offset:offset + width * kp * 16]
        parts.append(part.view(kp // 4, width, 64).transpose(0, 1))
        offset += part.numel()
    units = torch.cat(parts).view(groups, kp // 4, 4, 2, 4, 2)  # [g, u, c // 4, kk // 2, c % 4, kk % 2]
    data = units.permute(0, 2, 4, 1, 3, 5).reshape(groups * GROUP, kp)[:n, :k].contiguous()
    columns = packed.scales.transpose(1, 2).reshape(groups * GROUP, -1)[:n]  # [N, KB]
    if packed.kind == "tensor":
        scale = columns[:1, 0].clone()
    elif packed.kind == "channel":
        scale = columns[:, 0].clone()
    else:
        scale = columns[::packed.block[0]].contiguous()
    return Fp8Weight(data, scale, packed.kind, packed.block)
