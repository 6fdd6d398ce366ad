"""A quantized HF checkpoint's linear layers as our int4/int8 blocks (cpu_kernels/quant_format.py),
exactly: each published layout unpacked to integers q, a float32 scale s and integer zero z
per group of g input channels, w = s * (q - z), then re-blocked (`QuantizedTensor.from_groups`:
a group of 32 * m values is m blocks holding s and -s * z).

    GPTQ     qweight int32 [K/pf, N] (pf = 32 / bits values per int32, value j at bits*j, along K),
             qzeros int32 [G, N/pf] (along N; "gptq" (v1) stores z - 1, "gptq_v2" z), scales
             [G, N], g_idx int32 [K]: the group of each input channel
    AWQ      qweight int32 [K, N/8], qzeros [G, N/8]: nibble i of int32 c holds column
             8c + [0, 2, 4, 6, 1, 3, 5, 7][i]; scales [G, N]
    compressed-tensors  pack-quantized: weight_packed int32 [N, K/pf] (along K), value + 2^(bits-1)
             (q is signed); weight_zero_point packed likewise along N [N/pf, G] (asymmetric);
             weight_scale [N, G] ([N, 1] per channel), weight_g_idx [K] (act-order).
             int-/naive-quantized: `weight` int8 (signed q), weight_zero_point int8 [N, G].
    FP8      `weight` e4m3 [N, K] times weight_scale (compressed-tensors: per tensor, channel
             or block) or weight_scale_inv (quant_method fp8: [N/128, K/128] blocks)

Act-order's g_idx scatters each group over the input channels: the channels are sorted by
group (a stable argsort) so that each group is contiguous, and the layer gathers its
activations in that order (`QuantizedTensor.perm`). FP8 stays as stored (`Fp8Weight`, run by
engine/layers/fp8.py) for the layers the loader keeps in FP8; elsewhere it is dequantized.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Iterator
from contextlib import ExitStack
from pathlib import Path

import torch

from cpu_kernels.fp8_format import K_PAD, Fp8Weight
from cpu_kernels.quant_format import BLOCK, QuantizedTensor
from engine.models.hf_quant import PARTS, HFQuantConfig, QuantArgs, quantized_modules, read_dtypes

log = logging.getLogger("pagedserve.engine")
Weight = torch.Tensor | QuantizedTensor | Fp8Weight

_AWQ_COLUMNS = torch.tensor([0, 4, 1, 5, 2, 6, 3, 7])  # column j of 8 is nibble _AWQ_COLUMNS[j]
class Checkpoint:
    """The folder's safetensors: every tensor's file, from the headers; tensors read on demand."""

    def __init__(self, path: Path) -> None:
        from safetensors import safe_open
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"{path} has no *.safetensors weights")
        self._files = ExitStack()
        self.where = {}
        for file in files:
            handle = self._files.enter_context(safe_open(str(file), framework="pt"))
            self.where.update((name, handle) for name in handle.keys())
        self.dtypes = {name: handle.get_slice(name).get_dtype() for name, handle in self.where.items()}

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc) -> None:
        self._files.close()

    def get(self, name: str) -> torch.Tensor:
        return self.where[name].get_tensor(name)


def stored_formats(path: Path, q: HFQuantConfig) -> dict[str, str]:
    """HF tensor name -> "int4" | "int8" | "fp8", for the weights that can run as stored (FP8
    blocks narrower than the kernel's K_PAD columns stay dense)."""
    modules = quantized_modules(read_dtypes(path), q)
    return {f"{m}.weight": "fp8" if w.type == "float" else f"int{w.num_bits}" for m, w in modules.items()
            if w.type == "int" or w.strategy != "block" or w.block_structure[1] % K_PAD == 0}


def iter_quantized_weights(path: Path, q: HFQuantConfig, keep_quantized: bool, keep_fp8: Collection[str] = ()
                           ) -> Iterator[tuple[str, Weight]]:
    """(HF name, tensor) for every tensor of the folder; each quantized module's parts become
    one `{module}.weight`: int blocks with `keep_quantized` (where they re-block exactly), FP8
    as stored for the names in `keep_fp8`, else its float32 values."""
    scale, others = PARTS.get(q.method, (None, ()))  # mxfp4: no linear layer (gpt_oss.py reads its experts)
    with Checkpoint(path) as ckpt:
        modules = quantized_modules(ckpt.dtypes, q)
        dense_fp8 = [m for m, w in modules.items() if w.type == "float" and f"{m}.weight" not in keep_fp8]
        if dense_fp8 and keep_quantized:
            log.info("%s: %d FP8 layers are dequantized to the model's dtype at load", path.name, len(dense_fp8))
        for name in ckpt.where:
            module, _, part = name.rpartition(".")
            if module not in modules or part not in (scale, *others):
                yield name, ckpt.get(name)
            elif part == scale:
                parts = {p: ckpt.get(f"{module}.{p}") for p in (scale, *others) if f"{module}.{p}" in ckpt.where}
                fp8 = modules[module].type == "float"
                keep = f"{module}.weight" in keep_fp8 if fp8 else keep_quantized
                yield f"{module}.weight", read_weight(q, modules[module], parts, keep)


def read_weight(q: HFQuantConfig, w: QuantArgs, t: dict[str, torch.Tensor], keep_quantized: bool = True) -> Weight:
    """One module's stored tensors (by their names without the module) -> its weight."""
    if w.type == "float":
        return _fp8(t, q.method, w, keep_quantized)
    if q.method == "gptq":
        values, zeros = _unpack(t["qweight"], w.num_bits, 0).t(), _unpack(t["qzeros"], w.num_bits, 1).t()
        if q.format == "gptq":
            zeros = zeros + 1  # v1 stores z - 1 per value (AutoGPTQ; vLLM's and GPTQModel's reading)
        scales, g_idx = t["scales"].t(), t.get("g_idx")
    elif q.method == "awq":
        values, zeros = _awq_columns(_unpack(t["qweight"], 4, 1)).t(), _awq_columns(_unpack(t["qzeros"], 4, 1)).t()
        scales, g_idx = t["scales"].t(), None
    else:
        values, zeros, scales, g_idx = _compressed_tensors(t, q.format, w)
    n = values.shape[0]
    return _blocks(values.contiguous(), _per_row(scales, n).float(), zeros[:n], g_idx, w.num_bits, keep_quantized)


def _compressed_tensors(t: dict[str, torch.Tensor], fmt: str, w: QuantArgs):
    """(unsigned values, unsigned zeros, scales, g_idx): q + 2^(bits-1), as pack-quantized stores it."""
    offset = 1 << (w.num_bits - 1)
    if fmt == "pack-quantized":
        values = _unpack(t["weight_packed"], w.num_bits, 1)
        if "weight_shape" in t:
            values = values[:, :int(t["weight_shape"][1])]
    else:
        values = t["weight"].to(torch.int32) + offset
    scales = t["weight_scale"]
    if "weight_zero_point" not in t:
        zeros = torch.full((values.shape[0], 1), offset, dtype=torch.int32)
    elif fmt == "pack-quantized":
        zeros = _unpack(t["weight_zero_point"], w.num_bits, 0)[:values.shape[0]]
    else:
        zeros = t["weight_zero_point"].to(torch.int32) + offset
    return values, _per_row(zeros, values.shape[0]), scales, t.get("weight_g_idx")


def _unpack(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """int32 holding 32 / bits values (value j at bits * j) along `dim` -> int32 values."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    values = (packed.to(torch.int32).unsqueeze(-1) >> shifts) & ((1 << bits) - 1)  # [R, C, per]
    if dim == 1:
        return values.reshape(packed.shape[0], -1)
    return values.permute(0, 2, 1).reshape(-1, packed.shape[1])


def _awq_columns(values: torch.Tensor) -> torch.Tensor:
    """AWQ's interleaved nibble order -> natural column order."""
    return values.view(values.shape[0], -1, 8)[:, :, _AWQ_COLUMNS].reshape(values.shape[0], -1)


def _per_row(t: torch.Tensor, rows: int) -> torch.Tensor:
    """A per-tensor ([], [1]) or per-channel ([N, 1]) value as [N, G]."""
    t = t.reshape(1, 1) if t.numel() == 1 else t
    return t.expand(rows, -1) if t.shape[0] == 1 else t


def _blocks(values: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, g_idx: torch.Tensor | None,
            bits: int, keep_quantized: bool) -> Weight:
    """w = s * (q - z) per group: int4 blocks (zero -s * z, exact in float32 for fp16 and bf16
    scales), int8 blocks (q - z for the symmetric z = 128), or the float32 values when the
    groups do not cover whole blocks (or blocks are not wanted)."""
    n, k = values.shape
    size = k // scales.shape[1]
    zeros = zeros.expand(n, scales.shape[1])  # a symmetric zero: one per row
    perm = _group_order(g_idx, k, size)
    if perm is not None:
        values = values[:, perm]
    if keep_quantized and k % BLOCK == 0 and size % BLOCK == 0:
        if bits == 4:
            return QuantizedTensor.from_groups("int4", values.to(torch.uint8), scales, -scales * zeros, perm)
        if bool((zeros == 128).all()):
            return QuantizedTensor.from_groups("int8", (values - 128).to(torch.int8), scales, None, perm)
        raise ValueError("int8 weights with a zero point other than 128 are not supported (int8 blocks have none)")
    w = ((values - zeros.repeat_interleave(size, 1)).float() * scales.repeat_interleave(size, 1))
    return w if perm is None else torch.empty_like(w).index_copy_(1, perm, w)


def _group_order(g_idx: torch.Tensor | None, k: int, size: int) -> torch.Tensor | None:
    """The input channels sorted by group (None: already in order, or g_idx unset: -1)."""
    in_order = torch.arange(k) // size
    if g_idx is None or bool((g_idx < 0).any()) or torch.equal(g_idx.long(), in_order):
        return None
    perm = torch.argsort(g_idx.long(), stable=True)
    if not torch.equal(g_idx.long()[perm], in_order):
        raise ValueError(f"g_idx does not put {size} input channels in each group")
    return perm


def _fp8(t: dict[str, torch.Tensor], method: str, w: QuantArgs, keep_quantized: bool) -> Weight:
    """The e4m3 values and their float32 scales as stored, or (not `keep_quantized`) their
    products in float32 (each exact)."""
    scales = t["weight_scale_inv" if method == "fp8" else "weight_scale"].float()
    if keep_quantized:
        return Fp8Weight(t["weight"], scales, w.strategy, w.block_structure or (128, 128))
    weight = t["weight"].float()
    n, k = weight.shape
    if w.strategy != "block":
        return weight * _per_row(scales, n)
    rows, cols = w.block_structure
    return weight * scales.repeat_interleave(rows, 0)[:n].repeat_interleave(cols, 1)[:, :k]


def mark_int8_inputs(model: torch.nn.Module, q: HFQuantConfig, sources: dict[str, list[str]],
                     formats: dict[str, str]) -> None:
    """W8A8: the quantized layers whose scheme quantizes their inputs to int8 do so."""
    for layer, names in sources.items():
        scheme = q.scheme_for(names[0].removesuffix(".weight"))
        if layer in formats and scheme is not None and scheme.int8_inputs:
            model.get_submodule(layer).int8_inputs = True
