"""FP8 weights run as stored: e4m3 bytes and float32 scales, one byte a weight.

`Fp8Linear` loads a checkpoint's `Fp8Weight`s (engine/models/hf_quant_weights.py) into its
rows, a fused layer's parts (q, k, v; gate, up) one after another, then `pack`s them once
for cpu_kernels' fp8_linear (see cpu_kernels/fp8_format.py), which widens the bytes in
registers: the result is x.float() @ dequantized.T up to fp32 summation order.

    qweight  uint8 [N, K]     e4m3 bits, as stored (freed by pack)
    scales   float32 [N, KB]  each row's scale per block of k_block columns: per-tensor and
                              per-channel scales are one column, block scales ([N/bn, K/bk])
                              are repeated over their bn rows, so parts of any row count fuse
"""

from __future__ import annotations

import torch
from torch import nn

from cpu_kernels import fp8_format, ops
from cpu_kernels.fp8_format import Fp8Weight
from engine.layers import Layer


class Fp8Linear(Layer):
    """y = x @ W^T (+ bias) with W in FP8; float32 (or float16) activations run the kernel's
    float32 path, bfloat16 ones its bf16 path (AVX512-BF16, AMX where `amx`)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features, self.format = in_features, out_features, "fp8"
        self.register_buffer("qweight", torch.empty(out_features, in_features, dtype=torch.uint8))
        self.register_buffer("scales", None)  # allocated by the first part loaded (its k_block)
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.k_block: int | None = None  # columns per scale: in_features unless block scales
        self.packed: fp8_format.PackedFp8 | None = None
        self.amx = False

    @torch.no_grad()
    def load_rows(self, weight: Fp8Weight, offset: int) -> None:
        """Copy `weight` into rows offset.. (a part of a fused layer)."""
        rows, cols = weight.shape
        if cols != self.in_features or offset + rows > self.out_features:
            raise ValueError(f"shape mismatch: checkpoint ({rows}, {cols}) at row {offset} vs "
                             f"FP8 layer ({self.out_features}, {self.in_features})")
        k_block = weight.block[1] if weight.kind == "block" else self.in_features
        if self.scales is None:
            self.k_block = k_block
            self.scales = torch.empty(self.out_features, -(-self.in_features // k_block), device=self.qweight.device)
        elif k_block != self.k_block:
            raise ValueError(f"the parts of a fused FP8 layer ({self.out_features} x {self.in_features}) have "
                             f"different scale blocks ({self.k_block} and {k_block} columns)")
        self.qweight.narrow(0, offset, rows).copy_(weight.data)
        self.scales.narrow(0, offset, rows).copy_(weight.column_scales())

    @property
    def weight(self) -> Fp8Weight:
        if self.packed is not None:
            return fp8_format.unpack(self.packed)
        if self.k_block == self.in_features:
            return Fp8Weight(self.qweight, self.scales[:, 0].contiguous(), "channel")
        return Fp8Weight(self.qweight, self.scales, "block", (1, self.k_block))

    @torch.no_grad()
    def pack(self, amx: bool = False) -> None:
        """Into the kernel's layout, once loaded; the row-layout bytes are freed."""
        self.packed = fp8_format.pack(self.weight)
        self.qweight = self.scales = None
        self.amx = amx

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        if flat.dtype != torch.bfloat16:
            flat = flat.float()
        y = ops.fp8_linear(flat.contiguous(), self.packed, self.amx).to(x.dtype)
        y = y.view(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias
