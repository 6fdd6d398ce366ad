"""The batched LoRA term, grouped by adapter (Punica's SGMV, in plain torch).

A step's tokens belong to several adapters (and the base model, slot -1). For each adapter
present, its tokens are gathered, multiplied by its A then B, and added back: one matmul
pair per adapter in the step, whatever the number of tokens or requests, and no pass at all
for base-model tokens. Token order inside a group is the step's, so a token's result never
depends on what it is batched with beyond summation order inside the matmuls.
"""

from __future__ import annotations

import torch


def add_lora(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
             widths: list[int], groups: list[tuple[int, torch.Tensor | None]]) -> torch.Tensor:
    """y[rows] += (x[rows] @ A[slot]^T) @ B[slot]^T for each (slot, rows) group, in place.
    `lora_a` [slots, R, in], `lora_b` [slots, out, R] (B holds the scaling already);
    `widths[slot]` columns of R are in use (0: the adapter leaves this layer alone);
    rows None means every row of x."""
    for slot, rows in groups:
        width = widths[slot]
        if width == 0:
            continue
        a, b = lora_a[slot, :width], lora_b[slot, :, :width]
        if rows is None:
            y.add_(torch.mm(torch.mm(x, a.t()), b.t()).to(y.dtype))
        else:
            xs = x.index_select(0, rows)
            y.index_add_(0, rows, torch.mm(torch.mm(xs, a.t()), b.t()).to(y.dtype))
    return y


def reference_lora(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """One token set, one adapter: the unbatched term, for tests."""
    return (x @ a.t()) @ b.t()
