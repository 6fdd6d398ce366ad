"""Checkpoints for the weight-update tests: a tiny Llama with the bundled tokenizer's whole
vocabulary (so text prompts work), a copy with every tensor perturbed (same names and shapes,
other outputs), and one with another hidden size (wrong shapes)."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from helpers import build_tiny_model


def perturbed_copy(source: Path, target: Path, seed: int = 1, scale: float = 0.5) -> Path:
    """`source` with noise added to every weight: the same architecture, other greedy outputs."""
    shutil.copytree(source, target)
    generator = torch.Generator().manual_seed(seed)
    for file in target.glob("*.safetensors"):
        tensors = load_file(str(file))
        noisy = {name: t + scale * t.float().std() * torch.randn(t.shape, generator=generator).to(t.dtype)
                 for name, t in tensors.items()}
        save_file(noisy, str(file), metadata={"format": "pt"})
    return target


def weight_checkpoints(root: Path, tokenizer) -> dict[str, Path]:
    """{"a": the model, "b": its perturbed copy, "wide": another hidden size, "qwen2": another
    architecture}, under `root`."""
    vocab = len(tokenizer)
    a = build_tiny_model("llama", root / "a", tokenizer, vocab_size=vocab)
    return {"a": a, "b": perturbed_copy(a, root / "b"),
            "wide": build_tiny_model("llama", root / "wide", tokenizer, vocab_size=vocab, hidden_size=128),
            "qwen2": build_tiny_model("qwen2", root / "qwen2", tokenizer, vocab_size=vocab)}
