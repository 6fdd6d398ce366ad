"""Reading a LoRA adapter in PEFT format: `adapter_config.json` + `adapter_model.safetensors`.

PEFT stores, per adapted linear layer, A [r, in] and B [out, r]; the layer computes
W x + scaling * B (A x), scaling = lora_alpha / r (lora_alpha / sqrt(r) with use_rslora).
We fold the scaling into B once, here. Our model fuses q/k/v into `qkv_proj` and gate/up
into `gate_up_proj`; `TARGETS` says which fused layer and which slice of its output each
PEFT module name feeds.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from common.errors import LoraError

# PEFT module name -> (our layer, index of its output slice)
TARGETS = {
    "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
    "o_proj": ("o_proj", 0), "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    "down_proj": ("down_proj", 0),
}
_KEY = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.default)?\.weight$")
# Config features that change the math beyond W + s * B A: refused rather than run wrong.
_REFUSED = {"use_dora": "DoRA", "fan_in_fan_out": "fan_in_fan_out", "modules_to_save": "modules_to_save",
            "rank_pattern": "per-module ranks (rank_pattern)", "alpha_pattern": "per-module alphas (alpha_pattern)"}


@dataclass
class LoraAdapter:
    """One adapter, read into CPU memory in float32."""

    name: str
    path: str  # the folder, resolved
    rank: int
    scaling: float
    base_model: str | None  # adapter_config's base_model_name_or_path, for messages
    # (layer index, PEFT module name) -> (A [r, in], scaling * B [out, r])
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    @property
    def target_modules(self) -> list[str]:
        return sorted({module for _, module in self.weights})


def read_adapter(name: str, path: str, max_rank: int) -> LoraAdapter:
    """Raises LoraError("invalid") naming the problem: a missing or unreadable file, a rank
    above `max_rank`, a module or a PEFT feature we do not run."""
    if not name or any(c.isspace() for c in name) or "=" in name:
        raise LoraError(f"LoRA name {name!r}: must be non-empty, without spaces or '='")
    folder = Path(path).expanduser().resolve()
    config = _read_config(folder)
    rank, alpha = config.get("r"), config.get("lora_alpha", config.get("r"))
    if not isinstance(rank, int) or rank <= 0:
        raise LoraError(f"LoRA {name!r}: adapter_config.json has no positive integer r (got {rank!r})")
    if rank > max_rank:
        raise LoraError(f"LoRA {name!r}: rank {rank} exceeds --max-lora-rank {max_rank}")
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    adapter = LoraAdapter(name, str(folder), rank, float(scaling), config.get("base_model_name_or_path"))
    adapter.weights = _read_weights(name, folder, rank, adapter.scaling)
    if not adapter.weights:
        raise LoraError(f"LoRA {name!r}: {folder} holds no lora_A/lora_B weights")
    return adapter


def _read_config(folder: Path) -> dict:
    file = folder / "adapter_config.json"
    try:
        config = json.loads(file.read_text())
    except (OSError, ValueError) as e:
        raise LoraError(f"LoRA adapter {folder}: cannot read adapter_config.json ({e})") from None
    if config.get("peft_type", "LORA") != "LORA":
        raise LoraError(f"LoRA adapter {folder}: peft_type {config['peft_type']!r} (only LORA runs)")
    for key, what in _REFUSED.items():
        if config.get(key):
            raise LoraError(f"LoRA adapter {folder}: {what} is not supported")
    if config.get("bias", "none") != "none":
        raise LoraError(f"LoRA adapter {folder}: bias {config['bias']!r} is not supported (only 'none')")
    return config


def _read_weights(name: str, folder: Path, rank: int, scaling: float
                  ) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    from safetensors.torch import load_file
    file = folder / "adapter_model.safetensors"
    if not file.is_file():
        raise LoraError(f"LoRA {name!r}: {file} is missing (adapters are read from safetensors only)")
    try:
        tensors = load_file(str(file))
    except Exception as e:  # noqa: BLE001 - safetensors raises several types on a bad file
        raise LoraError(f"LoRA {name!r}: cannot read {file} ({e})") from None
    parts: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        m = _KEY.search(key)
        if m is None or m.group(2) not in TARGETS:
            raise LoraError(f"LoRA {name!r}: weight {key!r} is not a LoRA on one of "
                            f"{', '.join(TARGETS)}")
        parts.setdefault((int(m.group(1)), m.group(2)), {})[m.group(3)] = tensor.float()
    out = {}
    for (layer, module), ab in parts.items():
        a, b = ab.get("A"), ab.get("B")
        if a is None or b is None or a.shape[0] != rank or b.shape[1] != rank:
            raise LoraError(f"LoRA {name!r}: layer {layer} {module} needs lora_A [{rank}, in] and "
                            f"lora_B [out, {rank}]")
        out[(layer, module)] = (a.contiguous(), (b * scaling).contiguous())
    return out
