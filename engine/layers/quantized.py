"""Quantized weights, run as stored: int4 and int8 in blocks of 32 values, as GGUF keeps them.

    int4: w = scale * q + zero, q in 0..15   (GGUF Q4_1: zero = m; Q4_0: zero = -8 * d)
    int8: w = scale * q, q in -128..127      (GGUF Q8_0: -127..127)

`QuantLinear` runs them through `cpu_kernels`' quant_linear ops, which unpack each block
in registers and multiply it with float32 activations: the result is the float32 model of
the effective weights (`QuantizedTensor.dequantize()`), up to summation order, and never
depends on what a row is batched with. `reference_linear` is that product in plain torch.
In a bfloat16 model on a CPU with AVX512-BF16, `pack_modules` repacks the blocks for the
quant_linear_bf16 ops instead, which take the bf16 activations as they are (exact bf16 x
integer products, fp32 accumulation; see cpu_kernels/packing.py). Under --cpu-arithmetic int8,
`pack_int_dot_modules` packs them for the integer kernels (cpu_kernels/csrc/int_dot.cpp): the
activations rounded to 8 bits per block of 32, integer dot products, as llama.cpp computes.

HF checkpoints (engine/models/hf_quant.py) add two things a layer may carry: act-order's
permutation of the input channels (`perm`, gathered from the activations first), and W8A8's
int8 activations (`int8_inputs`: compressed-tensors' dynamic per-token scheme, run exactly in
int32 by `torch._int_mm`).

Loading: `quantize_modules` swaps a model's `nn.Linear`s for `QuantLinear`s (on the meta
device, before weights exist); `dequantize_modules` swaps them back for dense layers, where
the kernels cannot run.
"""

from __future__ import annotations

import dataclasses
import logging

import psutil
import torch
from torch import nn

from cpu_kernels import int_dot_format, ops
from cpu_kernels.int_dot_format import PackedIntDot
# The format itself lives with the kernels that pack it (cpu_kernels/quant_format.py).
from cpu_kernels.quant_format import BLOCK, FORMATS, QuantizedTensor, quantize
from engine.layers import Layer
from engine.layers.fp8 import Fp8Linear

log = logging.getLogger("pagedserve.engine")
UNPACKED_FROM_ROWS = 3  # see QuantLinear.pack
DEQUANTIZED_COPY_RAM_SHARE = 0.25  # see pack_modules


class QuantLinear(Layer):
    """y = x @ W^T (+ bias) with W quantized; activations of any float dtype (bfloat16 once
    packed for the bf16 kernels)."""

    def __init__(self, in_features: int, out_features: int, fmt: str, bias: bool = False) -> None:
        super().__init__()
        if fmt not in FORMATS:
            raise ValueError(f"quantization format {fmt!r} is not supported (supported: {', '.join(FORMATS)})")
        if in_features % BLOCK:
            raise ValueError(f"{fmt} needs in_features to be a multiple of {BLOCK}, got {in_features}")
        self.in_features, self.out_features, self.format = in_features, out_features, fmt
        packed = in_features // 2 if fmt == "int4" else in_features
        qdtype = torch.uint8 if fmt == "int4" else torch.int8
        self.register_buffer("qweight", torch.empty(out_features, packed, dtype=qdtype))
        self.register_buffer("scales", torch.empty(out_features, in_features // BLOCK, dtype=torch.float32))
        self.register_buffer("zeros", torch.empty(out_features, in_features // BLOCK, dtype=torch.float32)
                             if fmt == "int4" else None)
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.packed = False  # True after pack(): qweight holds the bf16 kernels' records
        self.zero_units = False  # packed int4: zeros as multiples of the scales (cpu_kernels/packing.py)
        self.amx = False  # packed: AMX arithmetic (cpu_kernels.dispatch chooses it per machine)
        self.unpacked_from_rows = UNPACKED_FROM_ROWS  # calls of this many rows on read `unpacked`
        self.unpacked: torch.Tensor | None = None  # packed int8 (or AMX with copies): bf16 values (see pack)
        self.register_buffer("perm", None)  # act-order: the input channels' order in the blocks
        self.perm_loaded = False  # a part was loaded: every other part must bring the same perm
        self.int8_inputs = False  # W8A8: activations quantized per token to int8 (see _int8_inputs)
        self.fp32_kernels = False  # stays on the float32 kernels: the bf16 ones would round its zeros
        self.int_dot: PackedIntDot | None = None  # packed for the integer kernels (pack_int_dot)

    @property
    def weight(self) -> QuantizedTensor:
        """The weight in the row layout (unpacked again if packed)."""
        if self.int_dot is not None:
            return dataclasses.replace(self.rows(torch.arange(self.out_features)), perm=self.perm)
        if self.packed:
            from cpu_kernels.packing import unpack
            return dataclasses.replace(unpack(self._packed()), perm=self.perm)
        return QuantizedTensor(self.format, self.qweight, self.scales, self.zeros, self.perm)

    def rows(self, ids: torch.Tensor) -> QuantizedTensor:
        """Rows `ids` of the weight, in the row layout (a tied embedding's lookup)."""
        if self.int_dot is not None:
            return int_dot_format.rows(self.int_dot, ids)
        if self.packed:
            from cpu_kernels.packing import unpack_rows
            return unpack_rows(self._packed(), ids)
        return self.weight.map_rows(lambda t: t.index_select(0, ids.flatten()))

    @torch.no_grad()
    def pack(self, amx: bool = False, dequantized_copy: bool = False) -> None:
        """Switch to the bf16 kernels' layout; from then on inputs must be bfloat16. `amx`:
        their AMX arithmetic, for every call (where `ops.bf16_amx_ready()`). `dequantized_copy`
        (AMX): also keep the weights dequantized to bf16 (2 bytes a weight) and run every
        call from them: no dequantizing per call, which at one row (decoding) doubles the time."""
        from cpu_kernels.packing import pack
        packed = pack(self.weight)
        self.qweight, self.zero_units = packed.data, packed.zero_units
        self.scales = self.zeros = None
        self.packed = True
        self.amx = amx
        self.unpacked_from_rows = UNPACKED_FROM_ROWS
        if amx and dequantized_copy:
            self.unpacked = ops.bf16_unpack(self.format, self.qweight, self.out_features, self.in_features, True,
                                            self.zero_units)
            self.unpacked_from_rows = 1
        elif self.format == "int8":
            # Unpacking int8 to bf16 costs more than the dot products it feeds: from
            # UNPACKED_FROM_ROWS rows on (a verification of drafts, a batch's LM head) the
            # kernel reads this copy instead, twice the int8 bytes. SmolLM2's tied
            # 49,152 x 576 LM head at 5 rows: 3.7 ms -> 2.4 ms; 1-2 rows stay on the packed
            # weights, which stream half the bytes.
            self.unpacked = ops.bf16_unpack(self.format, self.qweight, self.out_features, self.in_features, amx)

    @torch.no_grad()
    def pack_int_dot(self) -> None:
        """Switch to the integer kernels' layout (int_dot_format; the scales and zeros as stored)."""
        self.int_dot = int_dot_format.pack(self.weight)
        self.qweight, self.scales, self.zeros = self.int_dot.data, None, None

    def int_dot_ready(self) -> bool:
        """Whether the integer kernels take this layer: int4 or int8 blocks in input order, float
        activations (a W8A8 checkpoint's int8 activations have their own scheme)."""
        return self.perm is None and not self.int8_inputs and not self.packed

    def _packed(self):
        from cpu_kernels.packing import PackedWeight
        return PackedWeight(self.format, self.qweight, self.out_features, self.in_features, self.zero_units)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.perm is not None:
            x = x.index_select(-1, self.perm)
        if self.int_dot is not None:
            y = ops.int_dot_linear(x.reshape(-1, self.in_features).contiguous(), self.int_dot)
            y = y.view(*x.shape[:-1], self.out_features)
            return y if self.bias is None else y + self.bias
        if self.int8_inputs:
            y = self._int8_inputs(x.reshape(-1, self.in_features)).to(x.dtype).view(*x.shape[:-1], -1)
            return y if self.bias is None else y + self.bias
        if self.packed:
            flat = x.reshape(-1, self.in_features).contiguous()
            if self.unpacked is not None and flat.shape[0] >= self.unpacked_from_rows:
                y = ops.bf16_quant_linear_unpacked(flat, self.format, self.qweight, self.unpacked,
                                                   self.out_features, self.amx, self.zero_units)
            else:
                y = ops.bf16_quant_linear(flat, self.format, self.qweight, self.out_features, self.amx,
                                          self.zero_units)
            y = y.view(*x.shape[:-1], self.out_features)
            return y if self.bias is None else y + self.bias
        flat = x.reshape(-1, self.in_features).float().contiguous()
        if self.format == "int4":
            y = ops.int4_linear(flat, self.qweight, self.scales, self.zeros)
        else:
            y = ops.int8_linear(flat, self.qweight, self.scales)
        y = y.to(x.dtype).view(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias

    def _int8_inputs(self, flat: torch.Tensor) -> torch.Tensor:
        """W8A8 as compressed-tensors defines its dynamic symmetric per-token scheme: each
        row's scale is absmax / 127.5 (its observer's range 255 / 2), q = round(x / scale)
        clamped to -128..127; the int8 products summed exactly in int32, then rescaled once
        by the row's and the output channel's scales (int8 weights: one scale per row)."""
        x = flat.float()
        scale = (x.abs().amax(-1, keepdim=True) / 127.5).clamp(min=torch.finfo(torch.float32).eps)
        q = torch.round(x / scale).clamp(-128, 127).to(torch.int8)
        return torch._int_mm(q, self.qweight.t()).float() * (scale * self.scales[:, 0])

    @torch.no_grad()
    def load_rows(self, weight: QuantizedTensor | torch.Tensor, offset: int) -> None:
        """Copy `weight` into rows offset.. (a shard of a fused layer); float weights are
        quantized to this layer's format first."""
        if not isinstance(weight, QuantizedTensor):
            weight = quantize(weight, self.format)
        rows, cols = weight.shape
        if cols != self.in_features or offset + rows > self.out_features:
            raise ValueError(f"shape mismatch: checkpoint ({rows}, {cols}) at row {offset} vs "
                             f"quantized layer ({self.out_features}, {self.in_features})")
        if weight.format != self.format:
            raise ValueError(f"checkpoint block format {weight.format} vs layer format {self.format}")
        self._load_perm(weight.perm)
        for name, part in (("qweight", weight.qweight), ("scales", weight.scales), ("zeros", weight.zeros)):
            if part is not None:
                getattr(self, name).narrow(0, offset, rows).copy_(part)

    def bf16_kernels_exact(self) -> bool:
        """Whether the bf16 kernels hold this layer's scales and zeros exactly: as fp16 values
        (GGUF's) or as fp16 multiples of the scale (GPTQ's and AWQ's -scale * z; see
        cpu_kernels/packing.py). A bf16 scale too small for fp16 does not fit."""
        from cpu_kernels.packing import zero_encoding
        return self.packed or self.int_dot is not None or zero_encoding(self.weight) is not None

    def _load_perm(self, perm: torch.Tensor | None) -> None:
        """A fused layer's parts share one input, so they must share its permutation (GPTQ's
        act-order derives it from that input's statistics: q, k and v get the same)."""
        if not self.perm_loaded:
            self.perm, self.perm_loaded = None if perm is None else perm.to(self.qweight.device), True
        elif (perm is None) != (self.perm is None) or (
                perm is not None and not torch.equal(perm.cpu(), self.perm.cpu())):
            raise ValueError(f"the parts of a fused layer ({self.out_features} x {self.in_features}) have "
                             "different act-order permutations (g_idx): they cannot share one input order")


class QuantEmbedding(Layer):
    """An embedding table read from a quantized weight (shared with a tied LM head): the
    looked-up rows are dequantized."""

    def __init__(self, table: QuantLinear, dtype: torch.dtype) -> None:
        super().__init__()
        self.table = table
        self.out_dtype = dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.table.packed and self.out_dtype == torch.bfloat16:
            rows = ops.bf16_rows(self.table.format, self.table.qweight, self.table.out_features,
                                 self.table.in_features, ids.flatten().contiguous(), self.table.zero_units)
            return rows.view(*ids.shape, -1)
        return self.table.rows(ids).dequantize().to(self.out_dtype).view(*ids.shape, -1)


def quantize_modules(model: nn.Module, formats: dict[str, str], tie_embeddings: bool) -> None:
    """Replace the `nn.Linear` named in `formats` (module name -> format) by QuantLinear
    (Fp8Linear for "fp8").
    With tied embeddings and a quantized `lm_head`, the embedding reads the head's table.
    Names whose input width is not a multiple of 32 are dropped from `formats`: they stay dense."""
    for name, fmt in list(formats.items()):
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        dense = getattr(parent, attr)
        if fmt == "fp8":  # any width: the FP8 kernel pads K itself
            setattr(parent, attr, Fp8Linear(dense.in_features, dense.out_features, dense.bias is not None))
            continue
        if dense.in_features % BLOCK:
            # Under tensor parallelism, a row-parallel layer's share of the columns may fall
            # off the blocks: its slice is dequantized at load.
            log.info("%s runs dense: %d input columns are not a multiple of %d", name, dense.in_features, BLOCK)
            del formats[name]
            continue
        setattr(parent, attr, QuantLinear(dense.in_features, dense.out_features, fmt, dense.bias is not None))
    if tie_embeddings and "lm_head" in formats:
        embed = model.get_submodule("model.embed_tokens")
        model.model.embed_tokens = QuantEmbedding(model.lm_head, embed.weight.dtype)


def pack_modules(model: nn.Module, amx: bool = False) -> int:
    """Repack every QuantLinear for the bf16 kernels (a bfloat16 model on a CPU that runs
    them), in AMX arithmetic if `amx`; returns how many. AMX: the layers also keep their
    weights dequantized to bf16 where those copies take at most DEQUANTIZED_COPY_RAM_SHARE
    of the machine's memory (SmolLM2-135M: 270 MB)."""
    layers = [m for m in model.modules()
              if isinstance(m, QuantLinear) and not (m.fp32_kernels or m.int8_inputs or m.int_dot is not None)]
    copy_bytes = sum(2 * layer.in_features * layer.out_features for layer in layers)
    copies = amx and copy_bytes <= psutil.virtual_memory().total * DEQUANTIZED_COPY_RAM_SHARE
    for layer in layers:
        layer.pack(amx, copies)
    return len(layers)


def pack_int_dot_modules(model: nn.Module) -> int:
    """Pack every QuantLinear the integer kernels take (`int_dot_ready`) for them
    (--cpu-arithmetic int8); returns how many. The tied embedding reads its rows back from the
    head's packed bytes."""
    layers = [m for m in model.modules() if isinstance(m, QuantLinear) and m.int_dot_ready()]
    for layer in layers:
        layer.pack_int_dot()
    return len(layers)


@torch.no_grad()
def dense_linear(module: QuantLinear | Fp8Linear, dtype: torch.dtype) -> nn.Linear:
    """A dense layer of a quantized one's effective weights, and its bias, on its device."""
    weight = module.weight.dequantize()
    dense = nn.Linear(module.in_features, module.out_features, bias=module.bias is not None,
                      device=weight.device, dtype=dtype)
    dense.weight.copy_(weight)
    if module.bias is not None:
        dense.bias.copy_(module.bias)
    return dense


@torch.no_grad()
def dequantize_modules(model: nn.Module, dtype: torch.dtype) -> None:
    """Replace every QuantLinear/QuantEmbedding by a dense layer of the effective weights."""
    for name, module in list(model.named_modules(remove_duplicate=False)):
        # A tied head's table is reached twice: as `lm_head` and inside the embedding.
        if not isinstance(module, (QuantLinear, QuantEmbedding)) or name.endswith(".table"):
            continue
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        if isinstance(module, QuantEmbedding):
            dense = nn.Embedding.from_pretrained(module.table.weight.dequantize().to(dtype), freeze=True)
        else:
            dense = dense_linear(module, dtype)
        setattr(parent, attr, dense)
    if isinstance(getattr(model, "lm_head", None), nn.Linear) and model.config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight

