"""LoraManager: the adapters loaded (CPU), the `max_loras` slots resident in the model's
LoRA buffers, and each step's per-token slot indices.

Any adapter loaded can run; a step may use at most `max_loras` distinct ones (the scheduler
keeps to that), which `activate` makes resident, evicting the least recently used adapters
the step does not need. Slot -1 is the base model.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence

import torch
from torch import nn

from common.errors import LoraError
from engine.lora.adapter import TARGETS, LoraAdapter, read_adapter
from engine.lora.layers import LoraBatch, LoraLinear

log = logging.getLogger("pagedserve.engine")
BASE_SLOT = -1
_LAYER = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(qkv_proj|o_proj|gate_up_proj|down_proj)$")
# our layer -> the PEFT module of each output slice, in order
_SLICES = {ours: [peft for peft, (o, _) in sorted(TARGETS.items(), key=lambda kv: kv[1][1]) if o == ours]
           for ours in {o for o, _ in TARGETS.values()}}


class LoraManager:
    def __init__(self, model: nn.Module, arch, max_loras: int, max_rank: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.max_loras, self.max_rank, self.device = max_loras, max_rank, device
        self.batch = LoraBatch()
        self.layers = _wrap_layers(model, arch, self.batch, max_loras, max_rank, dtype, device)
        self.adapters: dict[str, LoraAdapter] = {}
        self.slots: list[str | None] = [None] * max_loras  # the adapter resident in each slot
        self._last_used = [0] * max_loras
        self._clock = 0

    # -- adapters ----------------------------------------------------------------

    def load(self, name: str, path: str) -> LoraAdapter:
        """Read and check an adapter; raises LoraError ("conflict" for a name in use)."""
        if name in self.adapters:
            raise LoraError(f"LoRA {name!r} is already loaded (from {self.adapters[name].path}); "
                            "unload it first", kind="conflict")
        adapter = read_adapter(name, path, self.max_rank)
        self._check_fits(adapter)
        self.adapters[name] = adapter
        log.info("LoRA %s loaded from %s (rank %d, %s)", name, adapter.path, adapter.rank,
                 ", ".join(adapter.target_modules))
        return adapter

    def unload(self, name: str) -> None:
        if name not in self.adapters:
            raise LoraError(f"LoRA {name!r} is not loaded", kind="not_found")
        del self.adapters[name]
        if name in self.slots:
            slot = self.slots.index(name)
            self.slots[slot] = None
            for layer in self.layers.values():
                layer.clear_slot(slot)
        log.info("LoRA %s unloaded", name)

    def _check_fits(self, adapter: LoraAdapter) -> None:
        for (layer_idx, module), (a, b) in adapter.weights.items():
            ours, part = TARGETS[module]
            layer = self.layers.get((layer_idx, ours))
            if layer is None or not layer.check_fits(part, a, b):
                raise LoraError(f"LoRA {adapter.name!r} does not fit this model: layer {layer_idx} "
                                f"{module} (A {tuple(a.shape)}, B {tuple(b.shape)}); it was trained "
                                f"for {adapter.base_model or 'another base model'}")

    # -- per step ----------------------------------------------------------------

    def activate(self, names: set[str]) -> dict[str, int]:
        """Make these adapters resident; returns each one's slot."""
        if len(names) > self.max_loras:
            raise RuntimeError(f"a step uses {len(names)} LoRA adapters, more than max_loras {self.max_loras}")
        self._clock += 1
        slot_of = {n: self.slots.index(n) for n in names if n in self.slots}
        for name in sorted(names - slot_of.keys()):
            taken = set(slot_of.values())
            slot = min((s for s in range(self.max_loras) if s not in taken),
                       key=lambda s: (self.slots[s] is not None, self._last_used[s]))
            self._write(slot, self.adapters[name])
            slot_of[name] = slot
        for slot in slot_of.values():
            self._last_used[slot] = self._clock
        return slot_of

    def _write(self, slot: int, adapter: LoraAdapter) -> None:
        for (layer_idx, ours), layer in self.layers.items():
            parts = [adapter.weights.get((layer_idx, peft)) for peft in _SLICES[ours]]
            layer.set_slot(slot, parts, adapter.rank)
        self.slots[slot] = adapter.name

    def assign_slots(self, names: Sequence[str | None], rows: Sequence) -> None:
        """Set each forward row's `lora_slot` from its request's adapter name (None: base)."""
        slot_of = self.activate({n for n in names if n})
        for name, row in zip(names, rows):
            row.lora_slot = slot_of[name] if name else BASE_SLOT

    def set_tokens(self, rows: Sequence) -> None:
        """The step's rows (in forward order) as contiguous (slot, start, end) segments;
        padding rows after them run as the base model."""
        segments: list[tuple[int, int, int]] = []
        position = 0
        for row in rows:
            end = position + len(row.token_ids)
            if row.lora_slot != BASE_SLOT:
                if segments and segments[-1][0] == row.lora_slot and segments[-1][2] == position:
                    segments[-1] = (row.lora_slot, segments[-1][1], end)
                else:
                    segments.append((row.lora_slot, position, end))
            position = end
        self.batch.segments = segments


def _wrap_layers(model: nn.Module, arch, batch: LoraBatch, max_loras: int, max_rank: int,
                 dtype: torch.dtype, device: torch.device) -> dict[tuple[int, str], LoraLinear]:
    """Swap every decoder layer's projections for LoraLinears around them (as
    `quantize_modules` swaps layers, so no model file changes)."""
    q, kv = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    wrapped = {}
    for name, module in list(model.named_modules()):
        m = _LAYER.search(name)
        if m is None:
            continue
        ours = m.group(2)
        out = module.out_features
        slices = {"qkv_proj": [q, kv, kv], "gate_up_proj": [out // 2, out // 2]}.get(ours, [out])
        parent, _, child = name.rpartition(".")
        layer = LoraLinear(module, slices, batch, max_loras, max_rank, dtype, device)
        setattr(model.get_submodule(parent), child, layer)
        wrapped[(int(m.group(1)), ours)] = layer
    if not wrapped:
        raise ValueError(f"enable_lora: found no projection layers to adapt in {type(model).__name__}")
    return wrapped
