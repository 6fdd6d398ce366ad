"""Multi-LoRA: many PEFT adapters on one base model, mixed in one batch (see docs/lora.md).

    adapter.py  read and check a PEFT adapter folder
    manager.py  the adapters loaded, the slots resident on the device, per-step slot indices
    layers.py   LoraLinear: a base linear layer (dense or quantized) plus the batched LoRA term
    ops.py      the batched math, grouped by adapter

The prefix-cache keys of an adapter's blocks are common.prefix_hash.block_extra_keys.
"""
