"""The exporters of tests/quant_checkpoints.py, for the formats no tool in use writes on CPU:
AWQ's GEMM layout (AutoAWQ is archived) and DeepSeek-V3's block FP8. They run in the project's
own env; each writes the linears in the format's tensors and the rest in the dtype such
checkpoints keep (AWQ: float16, as AutoAWQ saved them; DeepSeek-V3: bfloat16).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

def export(kind: str, base: Path, out: Path, linears: list[str], group_size: int, block: int) -> None:
    """`base` as an `awq` or `fp8-block` checkpoint in the new folder `out`, `linears` (weight
    names) quantized."""
    from safetensors.torch import load_file, save_file
    dtype = torch.float16 if kind == "awq" else torch.bfloat16
    tensors = {}
    for path in sorted(base.glob("*.safetensors")):
        tensors.update(load_file(str(path)))
    stored = {}
    for name, w in tensors.items():
        if name in linears:
            parts = _awq_linear(w.float(), group_size) if kind == "awq" else _fp8_block_linear(w.float(), block)
            stored.update({f"{name.removesuffix('.weight')}.{key}": t for key, t in parts.items()})
        else:
            stored[name] = w.to(dtype)
    out.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in stored.items()}, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((base / "config.json").read_text())
    config["dtype"] = str(dtype).removeprefix("torch.")
    config["quantization_config"] = (
        {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True, "version": "gemm",
         "modules_to_not_convert": None} if kind == "awq" else
        {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [block, block]})
    (out / "config.json").write_text(json.dumps(config, indent=2))


# AWQ's GEMM packing (AutoAWQ's WQLinear_GEMM): nibble i of each int32 holds column 8c + AWQ_ORDER[i].
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def _awq_linear(w: torch.Tensor, group_size: int) -> dict[str, torch.Tensor]:
    """AutoAWQ's round-to-nearest with zero points (pseudo_quantize_tensor, zero_point=True):
    per group s = (max - min) / 15, z = round(-min / s), q = clamp(round(w / s) + z, 0, 15)."""
    n, k = w.shape
    groups = w.view(n, k // group_size, group_size)
    low, high = groups.amin(-1, keepdim=True), groups.amax(-1, keepdim=True)
    scales = ((high - low).clamp(min=1e-5) / 15).half()  # stored fp16: quantize by what is stored
    zeros = (-torch.round(low / scales.float())).clamp(0, 15)
    q = (torch.round(groups / scales.float()) + zeros).clamp(0, 15).view(n, k)
    return {"qweight": _pack_awq(q.t()), "qzeros": _pack_awq(zeros.squeeze(-1).t()),
            "scales": scales.squeeze(-1).t().contiguous()}


def _pack_awq(values: torch.Tensor) -> torch.Tensor:
    """[R, C] values 0..15 -> int32 [R, C/8] in AWQ_ORDER."""
    v = values.to(torch.int64).view(values.shape[0], -1, 8)
    words = sum(v[..., column] << (4 * i) for i, column in enumerate(AWQ_ORDER))
    return _as_int32(words)


def _fp8_block_linear(w: torch.Tensor, block: int) -> dict[str, torch.Tensor]:
    """DeepSeek-V3's block FP8: e4m3 values and one float32 `weight_scale_inv` per block x block
    tile (amax / 448), w = value * scale_inv."""
    n, k = w.shape
    tiles = w.view(n // block, block, k // block, block)
    scale_inv = (tiles.abs().amax(dim=(1, 3)) / torch.finfo(torch.float8_e4m3fn).max).clamp(min=1e-12)
    values = (tiles / scale_inv[:, None, :, None]).view(n, k).to(torch.float8_e4m3fn)
    return {"weight": values, "weight_scale_inv": scale_inv.float()}


def _as_int32(words: torch.Tensor) -> torch.Tensor:
    """int64 words of 32 bits -> the int32s with those bits."""
    return ((words + 2**31) % 2**32 - 2**31).to(torch.int32)
