"""Random LoRA adapters in PEFT format, made with `peft` itself (never committed weights):
for the multi-LoRA benchmark and the tests. peft initialises B to zero (a no-op adapter),
so every A and B is drawn here from a seeded generator."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import torch


def save_random_adapter(model, folder: Path, rank: int, targets: Sequence[str], seed: int,
                        alpha: float | None = None, use_rslora: bool = False, b_std: float = 0.1) -> Path:
    """Wrap an HF model with a peft LoRA of this rank on `targets`, randomise it, save it to
    `folder` and take it off again (the model is left as it was, ready for the next one)."""
    from peft import LoraConfig, get_peft_model
    config = LoraConfig(r=rank, lora_alpha=alpha if alpha is not None else 2 * rank,
                        target_modules=list(targets), lora_dropout=0.0, use_rslora=use_rslora)
    peft_model = get_peft_model(model, config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if ".lora_A." in name:  # [r, in]
                param.copy_(torch.randn(param.shape, generator=generator) / math.sqrt(param.shape[1]))
            elif ".lora_B." in name:  # [out, r]
                param.copy_(torch.randn(param.shape, generator=generator) * b_std)
    peft_model.save_pretrained(str(folder))
    peft_model.unload()  # drops the LoRA layers without merging them
    return folder
