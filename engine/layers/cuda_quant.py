"""Quantized layers on CUDA, through torch's own kernels, so that a quantized checkpoint keeps
its bytes on the GPU too (the CPU kernels are cpu_kernels'):

    int4 blocks  `TinyGemmInt4Linear`: torch._weight_int4pack_mm, the tinygemm kernel gpt-fast and
                 torchao run int4 with: bf16 activations, 4-bit weights, a bf16 scale and zero
                 per group (32 values, or 64/128/256 where consecutive blocks share them, as
                 GPTQ's and AWQ's groups of 128 do). tinygemm computes w = (q - 8) * scale +
                 zero, so our w = s * q + z becomes scale = s, zero = z + 8 s, both rounded to
                 bf16 (a relative error under 2^-8 of a weight's scale: not exact, unlike the
                 CPU kernels). Needs N % 8 == 0.
    FP8, per-channel or per-tensor scales  `ScaledMmFp8Linear`: torch._scaled_mm on FP8 tensor
                 cores (compute capability 8.9 and up), activations quantized to e4m3 per token
                 (amax / 448, dynamic), as compressed-tensors' FP8_DYNAMIC scheme defines them;
                 the row-wise scales of both sides applied to the fp32 sums. bf16 models only.
    the rest     dense bf16/fp16 (`dequantize_modules`): int8 blocks (torch has no CUDA
                 int8-weight GEMM), block-scaled FP8, W8A8, a tied quantized embedding's table.

Both kernels were chosen by what torch ships, not yet by a measurement on a GPU: none was lent
while they were written. tests/kernels/test_cuda_quant.py runs both layers on CPU, through
torch's CPU tinygemm (the same scales and zeros, a CPU packing of the values) and its CPU
_scaled_mm, against their references, and on CUDA where a GPU is at hand.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from cpu_kernels.quant_format import BLOCK, QuantizedTensor, unpack_int4
from engine.layers import Layer
from engine.layers.fp8 import Fp8Linear
from engine.layers.quantized import QuantEmbedding, QuantLinear, dense_linear, dequantize_modules

log = logging.getLogger("pagedserve.engine")
TINYGEMM_GROUPS = (256, 128, 64, 32)
FP8_MAX = 448.0  # largest finite e4m3


def tinygemm_parts(weight: QuantizedTensor) -> tuple[torch.Tensor, int, torch.Tensor]:
    """(values uint8 [N, K] 0..15, group size, scales_and_zeros bf16 [K / group, N, 2]) of an
    int4 weight for torch's tinygemm: the widest group over which consecutive blocks share
    their scale and zero, and its zero shifted to tinygemm's midpoint form."""
    k = weight.shape[1]
    scales, zeros = weight.scales, weight.zeros
    group = next(g for g in TINYGEMM_GROUPS if k % g == 0 and _shared(scales, g) and _shared(zeros, g))
    every = group // BLOCK
    s, z = scales[:, ::every], zeros[:, ::every]
    parts = torch.stack([s, z + 8 * s], dim=-1).transpose(0, 1).contiguous().to(torch.bfloat16)
    return unpack_int4(weight.qweight), group, parts


def _shared(part: torch.Tensor, group: int) -> bool:
    """Whether each run of group / 32 blocks holds one value (a 32-value group always does)."""
    every = group // BLOCK
    return every == 1 or bool((part.view(part.shape[0], -1, every) == part[:, ::every, None]).all())


def inner_k_tiles(k: int) -> int:
    """tinygemm's K tiling: 8, 4 or 2 tiles of 16, the most that divide K."""
    return next(t for t in (8, 4, 2) if k % (16 * t) == 0)


class TinyGemmInt4Linear(Layer):
    """y = x @ W^T (+ bias), W int4 in tinygemm's layout (see the module's top). On a CPU
    tensor it runs torch's CPU tinygemm: only the tests do (the CPU kernels are exact)."""

    def __init__(self, layer: QuantLinear) -> None:
        super().__init__()
        self.in_features, self.out_features = layer.in_features, layer.out_features
        values, self.group, parts = tinygemm_parts(layer.weight)
        tiles = inner_k_tiles(self.in_features)
        if values.device.type == "cpu":
            packed = torch._convert_weight_to_int4pack_for_cpu(values.to(torch.int32), tiles)
            self.matmul = torch._weight_int4pack_mm_for_cpu
        else:
            nibbles = (values[:, ::2] << 4 | values[:, 1::2]).contiguous()  # its uint8 [N, K/2] input
            packed = torch._convert_weight_to_int4pack(nibbles, tiles)
            self.matmul = torch._weight_int4pack_mm
        self.register_buffer("packed", packed)
        self.register_buffer("scales_and_zeros", parts)
        self.register_buffer("perm", layer.perm)
        self.bias = layer.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.perm is not None:
            x = x.index_select(-1, self.perm)
        flat = x.reshape(-1, self.in_features).to(torch.bfloat16).contiguous()
        y = self.matmul(flat, self.packed, self.group, self.scales_and_zeros)
        y = y.to(x.dtype).view(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias


class ScaledMmFp8Linear(Layer):
    """y = x @ W^T (+ bias), W e4m3 with one scale per output row, through torch._scaled_mm
    (see the module's top). K is padded to a multiple of 16, as the FP8 GEMMs need."""

    def __init__(self, layer: Fp8Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = layer.in_features, layer.out_features
        self.k_padded = -(-self.in_features // 16) * 16
        weight = layer.qweight.view(torch.float8_e4m3fn)
        if self.k_padded != self.in_features:
            weight = nn.functional.pad(weight.view(torch.uint8), (0, self.k_padded - self.in_features)).view(
                torch.float8_e4m3fn)
        self.register_buffer("weight", weight.contiguous())  # [N, Kp]; .t() is the column-major operand
        self.register_buffer("weight_scale", layer.scales[:, 0].float().reshape(1, -1).contiguous())
        self.bias = layer.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        if self.k_padded != self.in_features:
            flat = nn.functional.pad(flat, (0, self.k_padded - self.in_features))
        q, scale = quantize_per_token(flat)
        y = torch._scaled_mm(q, self.weight.t(), scale_a=scale, scale_b=self.weight_scale, out_dtype=torch.bfloat16)
        y = y.to(x.dtype).view(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row to e4m3 with its own scale, amax / 448 (dynamic per-token FP8)."""
    scale = (x.abs().amax(-1, keepdim=True).float() / FP8_MAX).clamp(min=1e-12)
    q = (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale


def fp8_tensor_cores(device: torch.device | str) -> bool:
    """Whether `device` has FP8 tensor cores (Ada, Hopper and later: compute capability 8.9)."""
    return torch.cuda.is_available() and torch.cuda.get_device_capability(device) >= (8, 9)


@torch.no_grad()
def prepare_cuda(model: nn.Module, dtype: torch.dtype) -> None:
    """Replace what runs as stored on CUDA by its layer (see the module's top); every other
    quantized layer becomes dense `dtype`."""
    tables = {id(m.table) for m in model.modules() if isinstance(m, QuantEmbedding)}
    kept = {"int4": 0, "fp8": 0}
    for name, module in list(model.named_modules()):
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        if (isinstance(module, QuantLinear) and module.format == "int4" and dtype == torch.bfloat16
                and id(module) not in tables and not module.int8_inputs and module.out_features % 8 == 0):
            setattr(parent, attr, TinyGemmInt4Linear(module))
            kept["int4"] += 1
        elif isinstance(module, Fp8Linear):
            runs = (dtype == torch.bfloat16 and module.k_block == module.in_features
                    and fp8_tensor_cores(module.qweight.device))
            setattr(parent, attr, ScaledMmFp8Linear(module) if runs else dense_linear(module, dtype))
            kept["fp8"] += runs
    dequantize_modules(model, dtype)
    log.info("CUDA: %d int4 layers on tinygemm, %d FP8 layers on _scaled_mm; other quantized layers dense",
             kept["int4"], kept["fp8"])
