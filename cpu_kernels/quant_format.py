"""The quantized weight format: int4 and int8 in blocks of 32 values along K, as GGUF keeps
them (engine/layers/quantized.py runs them; cpu_kernels/packing.py repacks them).

    int4: w = scale * q + zero, q in 0..15   (GGUF Q4_1: zero = m; Q4_0: zero = -8 * d)
    int8: w = scale * q, q in -128..127      (GGUF Q8_0: -127..127)
    fp4:  w = scale * E2M1[q], zero 0        (MXFP4: scale a power of two; `from_mxfp4`)

fp4 is int4's layout with the nibbles read as e2m1 codes (the bf16 kernels take a different
table); it is a format of checkpoints (gpt-oss), not one `quantize` makes.

Checkpoints quantized in groups of 32 * m values (GPTQ, AWQ, compressed-tensors) become m
blocks sharing their group's scale and zero (`from_groups`); act-order's scattered groups are
made contiguous by a permutation of the input channels (`perm`), which the layer applies to
its activations.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cpu_kernels.mxfp4_format import E2M1

BLOCK = 32
FORMATS = ("int4", "int8")  # what `quantize` makes (--quantization)
NIBBLE_FORMATS = ("int4", "fp4")  # 4-bit layouts: packed two a byte, a scale and a zero per block


@dataclass
class QuantizedTensor:
    """A [N, K] weight in blocks of 32 along K."""

    format: str  # "int4" | "int8" | "fp4"
    qweight: torch.Tensor  # int4, fp4: uint8 [N, K/2], GGUF nibble order; int8: int8 [N, K]
    scales: torch.Tensor  # float32 [N, K/32]
    zeros: torch.Tensor | None = None  # int4, fp4: float32 [N, K/32]
    # int64 [K]: stored column i holds input channel perm[i] (act-order); None: the identity.
    perm: torch.Tensor | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return self.scales.shape[0], self.scales.shape[1] * BLOCK

    def dequantize(self) -> torch.Tensor:
        """The effective float32 weights: scale * q (+ zero), computed as gguf-py does."""
        n, k = self.shape
        values = unpack_int4(self.qweight) if self.format in NIBBLE_FORMATS else self.qweight
        if self.format == "fp4":
            values = torch.tensor(E2M1)[values.long()]
        w = values.view(n, k // BLOCK, BLOCK).float() * self.scales[..., None]
        if self.zeros is not None:
            w = w + self.zeros[..., None]
        w = w.view(n, k)
        if self.perm is not None:  # back to the input channels' own order
            w = torch.empty_like(w).index_copy_(1, self.perm, w)
        return w

    def map_rows(self, fn) -> QuantizedTensor:
        """The same weight with `fn` applied to the row dimension of every part."""
        return QuantizedTensor(self.format, fn(self.qweight), fn(self.scales),
                               None if self.zeros is None else fn(self.zeros), self.perm)

    @classmethod
    def from_groups(cls, fmt: str, values: torch.Tensor, scales: torch.Tensor,
                    zeros: torch.Tensor | None = None, perm: torch.Tensor | None = None) -> QuantizedTensor:
        """Re-block values quantized in G groups along K: values [N, K] (int4: 0..15, int8:
        int8), float32 scales (and int4 zeros) [N, G], w = scale * q (+ zero). A group of
        32 * m values becomes m blocks holding its scale and zero, so the weights are the
        same floats."""
        n, k = values.shape
        groups = scales.shape[1]
        if k % groups or (k // groups) % BLOCK:
            raise ValueError(f"groups of {k / groups:g} values cannot be re-blocked exactly into blocks of {BLOCK}")
        per = k // groups // BLOCK
        scales = scales.float().repeat_interleave(per, dim=1).contiguous()
        if fmt == "int4":
            zeros = zeros.float().repeat_interleave(per, dim=1).contiguous()
            return cls("int4", pack_int4(values), scales, zeros, perm)
        return cls("int8", values.to(torch.int8).contiguous(), scales, None, perm)


def from_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> QuantizedTensor:
    """An MXFP4 matrix (blocks uint8 [N, K/32, 16], value 2j in byte j's low nibble; scales
    uint8 [N, K/32], e8m0) as an fp4 weight: the same codes in our nibble order, each block's
    scale 2^(byte - 127) in float32, zeros 0. Dequantizes to mxfp4_format.dequantize's values."""
    from cpu_kernels import mxfp4_format
    mxfp4_format.check(blocks, scales, "weight")
    n = blocks.shape[0]
    codes = torch.stack([blocks & 15, blocks >> 4], dim=-1).reshape(n, -1)  # [N, K] in order
    exponents = scales.to(torch.int32) - mxfp4_format.SCALE_BIAS
    block_scales = torch.ldexp(torch.ones(exponents.shape), exponents)
    return QuantizedTensor("fp4", pack_int4(codes), block_scales, torch.zeros_like(block_scales))


def to_mxfp4(weight: QuantizedTensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`from_mxfp4`'s inverse: an fp4 weight as MXFP4 (blocks uint8 [N, K/32, 16], scales
    uint8 [N, K/32] e8m0), the form the integer kernel packs (mxfp4_format.pack_int8)."""
    from cpu_kernels import mxfp4_format
    if weight.format != "fp4":
        raise ValueError(f"to_mxfp4 takes an fp4 weight, not {weight.format}")
    n = weight.qweight.shape[0]
    codes = unpack_int4(weight.qweight)  # [N, K] in order
    blocks = (codes[:, 0::2] | (codes[:, 1::2] << 4)).view(n, -1, BLOCK // 2)
    exponents = torch.frexp(weight.scales)[1] - 1  # scale = 2^exponent
    e8m0 = torch.where(weight.scales > 0, exponents + mxfp4_format.SCALE_BIAS, 0)  # 2^-127, flushed: 0
    return blocks.contiguous(), e8m0.clamp(0, 255).to(torch.uint8)


def unpack_int4(qweight: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K/2] -> uint8 [N, K]: byte j of a block holds value j and j + 16."""
    n = qweight.shape[0]
    blocks = qweight.view(n, -1, BLOCK // 2)
    return torch.cat([blocks & 15, blocks >> 4], dim=-1).view(n, -1)


def pack_int4(values: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K] of 0..15 -> the packed [N, K/2] layout."""
    n = values.shape[0]
    blocks = values.to(torch.uint8).view(n, -1, BLOCK)
    return (blocks[..., :BLOCK // 2] | (blocks[..., BLOCK // 2:] << 4)).view(n, -1)


def quantize(weight: torch.Tensor, fmt: str) -> QuantizedTensor:
    """Quantize float weights [N, K] per block of 32: int4 asymmetric (min and step, as
    Q4_1, both rounded to fp16), int8 symmetric (absmax / 127, as Q8_0)."""
    n, k = weight.shape
    if k % BLOCK:
        raise ValueError(f"cannot quantize a weight with {k} columns: not a multiple of {BLOCK}")
    w = weight.float().view(n, k // BLOCK, BLOCK)
    if fmt == "int8":
        scales = w.abs().amax(-1) / 127
        q = torch.round(w * _inverse(scales)[..., None]).clamp(-127, 127).to(torch.int8)
        return QuantizedTensor("int8", q.view(n, k), scales)
    if fmt == "int4":
        # Step and minimum are stored as fp16, as in GGUF's Q4_1 (the bf16 kernels read them so).
        low = w.amin(-1).half().float()
        scales = ((w.amax(-1) - low) / 15).half().float()
        q = torch.round((w - low[..., None]) * _inverse(scales)[..., None]).clamp(0, 15)
        return QuantizedTensor("int4", pack_int4(q.view(n, k)), scales, low)
    raise ValueError(f"quantization format {fmt!r} is not supported (supported: {', '.join(FORMATS)})")


def _inverse(scales: torch.Tensor) -> torch.Tensor:
    return torch.where(scales != 0, 1 / scales, torch.zeros_like(scales))


def reference_linear(x: torch.Tensor, weight: QuantizedTensor) -> torch.Tensor:
    """What the kernels compute, in float64 and plain torch: x times the effective weights."""
    return (x.double() @ weight.dequantize().double().t()).float()
