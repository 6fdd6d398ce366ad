"""Tiny LoRA set-ups for the multi-LoRA tests: a tiny random Llama, peft adapters of
different ranks and targets on it, and HF+PEFT references with each adapter merged."""

from __future__ import annotations

import random
from pathlib import Path

import torch

from bench.lora_adapters import save_random_adapter
from helpers import build_tiny_model, hf_greedy

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# name -> (rank, targets, use_rslora): different ranks, fused and unfused layers, rsLoRA
ADAPTERS = {
    "a": (8, ["q_proj", "v_proj"], False),
    "b": (4, ALL, True),
    "c": (16, ["o_proj", "gate_proj", "down_proj"], False),
}


def build_lora_setup(root: Path, tokenizer) -> tuple[Path, dict[str, Path]]:
    """The tiny base model's folder and each adapter's folder."""
    from transformers import AutoModelForCausalLM
    folder = build_tiny_model("llama", root / "base", tokenizer)
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    adapters = {}
    for seed, (name, (rank, targets, rslora)) in enumerate(ADAPTERS.items()):
        adapters[name] = save_random_adapter(model, root / name, rank, targets, seed=seed, use_rslora=rslora)
    return folder, adapters


def merged_model(folder: Path, adapter: Path | None):
    """HF's model with the adapter merged into its weights (peft's merge_and_unload)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM
    base = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    return base if adapter is None else PeftModel.from_pretrained(base, str(adapter)).merge_and_unload()


def references(folder: Path, adapters: dict[str, Path], prompts: list[list[int]], max_new: int) -> dict:
    """(adapter name or None) -> HF greedy (tokens, logprobs) per prompt."""
    return {name: hf_greedy(merged_model(folder, adapters.get(name)), prompts, max_new)
            for name in (None, *adapters)}


def lora_prompts(vocab_size: int = 512) -> list[list[int]]:
    """Two sharing a 40-token prefix, and others of 3 to 70 tokens."""
    rng = random.Random(1)
    prefix = [rng.randrange(3, vocab_size) for _ in range(40)]
    return ([prefix + [rng.randrange(3, vocab_size) for _ in range(n)] for n in (6, 20)]
            + [[rng.randrange(3, vocab_size) for _ in range(n)] for n in (3, 70)])
