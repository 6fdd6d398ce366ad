"""Multi-LoRA: many PEFT adapters on one base model, mixed in one batch (see docs/lora.md).

    adapter.py  read and check a PEFT adapter folder
    manager.py  the adapters loaded, the slots resident on the device, per-step slot indices
    layers.py   LoraLinear: a base linear layer (dense or quantized) plus the batched LoRA term
    ops.py      the batched math, grouped by adapter

This module itself imports no torch: the frontend's router imports `block_extra_keys`.
"""

from __future__ import annotations


def block_extra_keys(lora_name: str | None, lora_path: str | None = None) -> tuple:
    """The prefix-cache extra keys of a request's blocks (engine.block_manager.hash_block):
    () for the base model, so its hashes stay what they were; for an adapter its name and
    the engine's path to it (`LoraAdapter.path`), so base and adapter requests never share
    KV, and an adapter unloaded and loaded again from another folder never hits stale blocks."""
    if not lora_name:
        return ()
    return ("lora", lora_name, lora_path or "")
