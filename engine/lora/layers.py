"""LoraLinear: a model's linear layer (nn.Linear or QuantLinear, left as it is) plus the
LoRA term of whichever adapters the step's tokens use.

Every adapter slot has the same stacked buffers, zero-padded to the largest rank:

    lora_a [max_loras, n * max_rank, in]     n = output slices (qkv_proj: 3, gate_up_proj: 2, else 1)
    lora_b [max_loras, n * max_rank, out]    B transposed, block-diagonal: slice j's outputs read
                                             only slice j's A columns

so a fused layer's q, k and v LoRAs (PEFT trains them separately) run as one matmul pair.
An adapter of rank r fills the first n * r rows of each; the rest is never read. B is kept
transposed so that both slices a step reads are contiguous (oneDNN copies strided operands).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from engine.lora.ops import add_lora


@dataclass
class LoraBatch:
    """The current step's (slot, start row, end row) segments, shared by every LoraLinear of
    the model; the model runner sets them before each forward. Empty: no token uses an adapter."""

    segments: list[tuple[int, int, int]] = field(default_factory=list)


class LoraLinear(nn.Module):
    def __init__(self, base: nn.Module, slices: list[int], batch: LoraBatch, max_loras: int,
                 max_rank: int, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.base, self.slices, self.batch, self.max_rank = base, slices, batch, max_rank
        self.in_features = base.in_features
        n = len(slices)
        self.register_buffer("lora_a", torch.zeros(max_loras, n * max_rank, self.in_features,
                                                   dtype=dtype, device=device), persistent=False)
        self.register_buffer("lora_b", torch.zeros(max_loras, n * max_rank, sum(slices),
                                                   dtype=dtype, device=device), persistent=False)
        # Per slot: (A^T [in, w], B^T [w, out]) views of the rows in use, made once per load
        # (slicing per step costs more than it seems at ~100 layer calls); None: no LoRA here.
        self.views: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * max_loras

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        if self.batch.segments:
            add_lora(y, x, self.views, self.batch.segments)
        return y

    def check_fits(self, part: int, a: torch.Tensor, b: torch.Tensor) -> bool:
        return a.shape[1] == self.in_features and b.shape[0] == self.slices[part]

    @torch.no_grad()
    def set_slot(self, slot: int, parts: list[tuple[torch.Tensor, torch.Tensor] | None], rank: int) -> None:
        """Write an adapter's (A, B) for each output slice (None: not adapted) into `slot`."""
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()
        if all(p is None for p in parts):
            self.views[slot] = None
            return
        row = 0
        for j, part in enumerate(parts):
            if part is not None:
                a, b = part
                cols = slice(j * rank, (j + 1) * rank)
                self.lora_a[slot, cols] = a.to(self.lora_a.dtype)
                self.lora_b[slot, cols, row:row + self.slices[j]] = b.t().to(self.lora_b.dtype)
            row += self.slices[j]
        width = len(parts) * rank
        self.views[slot] = (self.lora_a[slot, :width].t(), self.lora_b[slot, :width])

    def clear_slot(self, slot: int) -> None:
        self.views[slot] = None
