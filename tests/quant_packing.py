"""Quantized HF layouts packed by hand from their published definitions (GPTQ, AWQ GEMM,
compressed-tensors, block FP8), independently of the loader's readers, so that the tests pin
every packing order; and small checkpoints of a tiny float model in each layout.

Each layout dequantizes as w = s * (q - z) per group of input channels, q and z unsigned:

    GPTQ    qweight int32 [K/pf, N]: value j of int32 i along K is q[pf*i + j] at bits 4j (pf = 32 / bits);
            qzeros int32 [G, N/pf] along N, v1 ("gptq") storing z - 1; scales fp16 [G, N]; g_idx [K]
    AWQ     qweight int32 [K, N/8], qzeros [G, N/8]: nibble i of int32 c is column 8c + AWQ_ORDER[i]
    compressed-tensors pack-quantized: weight_packed [N, K/pf] along K of q_signed + 2^(bits-1) (= our
            unsigned q), weight_zero_point [N/pf, G] along N; weight_scale [N, G]; weight_g_idx [K]
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


def pack_int32(values: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Unsigned values [R, C] -> int32 holding 32 / bits of them along `dim`, value j of
    each int32 at bits * j (the last one zero-padded)."""
    v = values.to(torch.int64)
    v = v.t() if dim == 0 else v
    per = 32 // bits
    v = F.pad(v, (0, -v.shape[1] % per)).view(v.shape[0], -1, per)
    packed = sum(v[..., j] << (bits * j) for j in range(per))
    packed = ((packed + 2**31) % 2**32 - 2**31).to(torch.int32)  # as two's complement int32
    return packed.t().contiguous() if dim == 0 else packed


def pack_awq(values: torch.Tensor) -> torch.Tensor:
    """Unsigned 4-bit values [R, C] -> int32 [R, C/8] in AWQ's GEMM order."""
    v = values.to(torch.int64).view(values.shape[0], -1, 8)
    packed = sum(v[..., AWQ_ORDER[i]] << (4 * i) for i in range(8))
    return ((packed + 2**31) % 2**32 - 2**31).to(torch.int32)


@dataclass
class Grouped:
    """Weights quantized in groups: w[n, k] = s[n, g_idx[k]] * (q[n, k] - z[n, g_idx[k]])."""

    q: torch.Tensor  # int64 [N, K], 0 .. 2^bits - 1
    s: torch.Tensor  # fp16 (or bf16) [N, G]
    z: torch.Tensor  # int64 [N, G]
    g_idx: torch.Tensor  # int32 [K]

    def dequantize(self) -> torch.Tensor:
        """float64: each value exact (a 16-bit scale times a small integer)."""
        g = self.g_idx.long()
        return self.s.double()[:, g] * (self.q - self.z[:, g]).double()


def quantize_groups(w: torch.Tensor, bits: int, group: int, sym: bool, act_order: torch.Tensor | None = None,
                    scale_dtype: torch.dtype = torch.float16) -> Grouped:
    """Round-to-nearest in groups of `group` input channels (act_order: a permutation; group j
    holds channels act_order[j*group:(j+1)*group], as GPTQ's desc_act makes them)."""
    n, k = w.shape
    order = torch.arange(k) if act_order is None else act_order
    g_idx = torch.empty(k, dtype=torch.int32)
    g_idx[order] = (torch.arange(k) // group).to(torch.int32)
    grouped = w[:, order].view(n, k // group, group).double()
    top = 2**bits - 1
    if sym:
        s = (grouped.abs().amax(-1) / (2 ** (bits - 1) - 1)).clamp(min=1e-4).to(scale_dtype)
        z = torch.full(s.shape, 2 ** (bits - 1), dtype=torch.int64)
    else:
        low, high = grouped.amin(-1), grouped.amax(-1)
        s = ((high - low) / top).clamp(min=1e-4).to(scale_dtype)
        z = torch.round(-low / s.double()).clamp(1, top).long()  # >= 1: GPTQ v1 stores z - 1
    q = torch.round(grouped / s.double()[..., None] + z[..., None]).clamp(0, top).long().view(n, k)
    return Grouped(torch.empty_like(q).index_copy_(1, order, q), s, z, g_idx)


def gptq_tensors(g: Grouped, bits: int, v1: bool = True) -> dict[str, torch.Tensor]:
    return {"qweight": pack_int32(g.q.t(), bits, 0), "qzeros": pack_int32(g.z.t() - int(v1), bits, 1),
            "scales": g.s.t().contiguous(), "g_idx": g.g_idx}


def awq_tensors(g: Grouped) -> dict[str, torch.Tensor]:
    return {"qweight": pack_awq(g.q.t()), "qzeros": pack_awq(g.z.t()), "scales": g.s.t().contiguous()}


def ct_packed_tensors(g: Grouped, bits: int, sym: bool, act_order: bool) -> dict[str, torch.Tensor]:
    n, k = g.q.shape
    out = {"weight_packed": pack_int32(g.q, bits, 1), "weight_scale": g.s, "weight_shape": torch.tensor([n, k])}
    if not sym:
        out["weight_zero_point"] = pack_int32(g.z, bits, 0)
    if act_order:
        out["weight_g_idx"] = g.g_idx
    return out


def ct_int8_tensors(g: Grouped) -> dict[str, torch.Tensor]:
    """int-quantized: the signed values as int8, a scale per output channel."""
    return {"weight": (g.q - 128).to(torch.int8), "weight_scale": g.s}


def fp8_block(w: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 values and float32 [N/block, K/block] scales (DeepSeek-V3's weight_scale_inv)."""
    n, k = w.shape
    blocks = w.view(n // block, block, k // block, block)
    scales = (blocks.abs().amax(dim=(1, 3)) / 448).clamp(min=1e-6).float()
    values = (blocks / scales[:, None, :, None]).view(n, k).to(torch.float8_e4m3fn)
    return values, scales


def fp8_dequantize(values: torch.Tensor, scales: torch.Tensor, block: int) -> torch.Tensor:
    return values.double() * scales.double().repeat_interleave(block, 0).repeat_interleave(block, 1)


# -- Checkpoints of a tiny float model -------------------------------------------------

def _ct(weights: dict, fmt: str = "pack-quantized", inputs: dict | None = None) -> dict:
    group = {"targets": ["Linear"], "weights": {"type": "int", **weights}, "input_activations": inputs}
    return {"quant_method": "compressed-tensors", "format": fmt, "config_groups": {"group_0": group},
            "ignore": ["lm_head"], "quantization_status": "compressed"}


@dataclass(frozen=True)
class Kind:
    """A checkpoint layout: its quantization_config and how the test packs it."""

    config: dict
    layout: str  # gptq | awq | ct-packed | ct-int8 | ct-fp8 | fp8
    bits: int = 4
    group: int | None = None  # None: one group per output channel
    sym: bool = True
    act_order: bool = False
    v1: bool = True  # GPTQ: qzeros hold z - 1


KINDS = {
    "gptq": Kind({"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False, "sym": True}, "gptq", group=32),
    "gptq-actorder-asym": Kind({"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": True, "sym": False},
                               "gptq", group=32, sym=False, act_order=True),
    "gptq-v2-channel": Kind({"quant_method": "gptq", "bits": 4, "group_size": -1, "sym": False,
                             "checkpoint_format": "gptq_v2"}, "gptq", sym=False, v1=False),
    "gptq-int8": Kind({"quant_method": "gptq", "bits": 8, "group_size": 32, "desc_act": True, "sym": True},
                      "gptq", bits=8, group=32, act_order=True),
    "awq": Kind({"quant_method": "awq", "bits": 4, "group_size": 64, "zero_point": True, "version": "gemm"},
                "awq", group=64, sym=False),
    "ct-w4a16": Kind(_ct({"num_bits": 4, "symmetric": True, "strategy": "group", "group_size": 64}),
                     "ct-packed", group=64),
    "ct-w4a16-asym-actorder": Kind(_ct({"num_bits": 4, "symmetric": False, "strategy": "group", "group_size": 32,
                                        "actorder": "group"}), "ct-packed", group=32, sym=False, act_order=True),
    "ct-w8a16": Kind(_ct({"num_bits": 8, "symmetric": True, "strategy": "channel"}), "ct-packed", bits=8),
    "ct-w8a8": Kind(_ct({"num_bits": 8, "symmetric": True, "strategy": "channel"}, "int-quantized",
                        {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "dynamic": True}),
                    "ct-int8", bits=8),
    "ct-fp8": Kind(_ct({"num_bits": 8, "type": "float", "strategy": "channel"}, "float-quantized",
                       {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}), "ct-fp8", bits=8),
    "fp8-block": Kind({"quant_method": "fp8", "weight_block_size": [32, 32], "activation_scheme": "dynamic"},
                      "fp8", bits=8, group=32),
}
# q/k/v and gate/up read one input each: act-order gives them one permutation.
_INPUTS = {"q_proj": "attn", "k_proj": "attn", "v_proj": "attn", "o_proj": "o", "gate_proj": "mlp",
           "up_proj": "mlp", "down_proj": "down"}


def quantize_layer(kind: str, w: torch.Tensor, order: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """One layer in `kind`'s layout, and its dequantized float64 weights."""
    spec = KINDS[kind]
    if spec.layout == "fp8":
        values, scales = fp8_block(w, spec.group)
        return {"weight": values, "weight_scale_inv": scales}, fp8_dequantize(values, scales, spec.group)
    if spec.layout == "ct-fp8":  # a scale per output channel
        scales = (w.abs().amax(1, keepdim=True) / 448).clamp(min=1e-6)
        values = (w / scales).to(torch.float8_e4m3fn)
        return {"weight": values, "weight_scale": scales}, values.double() * scales.double()
    g = quantize_groups(w, spec.bits, spec.group or w.shape[1], spec.sym, order if spec.act_order else None)
    tensors = {"gptq": lambda: gptq_tensors(g, spec.bits, spec.v1), "awq": lambda: awq_tensors(g),
               "ct-packed": lambda: ct_packed_tensors(g, spec.bits, spec.sym, spec.act_order),
               "ct-int8": lambda: ct_int8_tensors(g)}[spec.layout]()
    return tensors, g.dequantize()


def export(base: Path, out: Path, reference: Path, kind: str) -> None:
    """`base` (a float HF folder) in `kind`'s layout into `out`, and its dequantized weights
    as a float32 folder `reference` (the exactness tests' float model)."""
    from safetensors.torch import load_file, save_file
    tensors, dense = load_file(str(base / "model.safetensors")), {}
    quantized = {}
    rng = torch.Generator().manual_seed(0)
    orders: dict[tuple[str, str], torch.Tensor] = {}
    for name, w in tensors.items():
        module, _, part = name.rpartition(".")
        layer, _, proj = module.rpartition(".")
        if part != "weight" or proj not in _INPUTS:
            quantized[name] = dense[name] = w
            continue
        order = orders.setdefault((layer, _INPUTS[proj]), torch.randperm(w.shape[1], generator=rng))
        stored, values = quantize_layer(kind, w.float(), order)
        quantized.update({f"{module}.{key}": t for key, t in stored.items()})
        dense[name] = values.float()
    for folder, weights in ((out, quantized), (reference, dense)):
        shutil.copytree(base, folder, ignore=shutil.ignore_patterns("*.safetensors"))
        save_file({k: v.contiguous() for k, v in weights.items()}, str(folder / "model.safetensors"))
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = KINDS[kind].config
    (out / "config.json").write_text(json.dumps(config))


def mxfp4_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP4 by the OCP Microscaling rules (cpu_kernels/mxfp4_format.py `quantize`, which
    --quantization mxfp4 uses too): its dequantization is checked against transformers'."""
    from cpu_kernels.mxfp4_format import quantize
    return quantize(w)


def export_mxfp4_experts(base: Path, out: Path) -> None:
    """A float gpt-oss folder with its experts' matrices in MXFP4, as OpenAI ships them
    (`*_blocks` / `*_scales`, rows the output features), biases and everything else as they were."""
    from safetensors.torch import load_file, save_file
    shutil.copytree(base, out, ignore=shutil.ignore_patterns("*.safetensors"))
    tensors, stored = load_file(str(base / "model.safetensors")), {}
    for name, t in tensors.items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            blocks, scales = mxfp4_quantize(t.transpose(1, 2))  # [E, out, in]
            stored[f"{name}_blocks"], stored[f"{name}_scales"] = blocks, scales
        else:
            stored[name] = t
    save_file(stored, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (out / "config.json").write_text(json.dumps(config))
