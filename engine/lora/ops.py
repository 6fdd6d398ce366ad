"""The batched LoRA term, grouped by adapter (Punica's SGMV, in plain torch).

A step's tokens belong to several adapters (and the base model, slot -1). The model runner
orders a step's requests by adapter (decodes first, then prefills), so each adapter's tokens
form at most two contiguous segments: one matmul pair (x A^T, then B^T) per segment, whatever
the number of tokens or requests, and no pass at all for base-model tokens. Token order inside a group is the step's, so a token's result never
depends on what it is batched with beyond summation order inside the matmuls.
"""

from __future__ import annotations

import torch


def add_lora(y: torch.Tensor, x: torch.Tensor, views: list[tuple[torch.Tensor, torch.Tensor] | None],
             segments: list[tuple[int, int, int]]) -> torch.Tensor:
    """y[start:end] += (x[start:end] @ A[slot]^T) @ B[slot]^T for each (slot, start, end)
    segment, in place. `views[slot]`: (A^T [in, w], B^T [w, out], the scaling in B), w the
    rows in use; None: the adapter leaves this layer alone. Segments are contiguous rows: the
    model runner orders a step's requests by adapter, so there are no gathers or scatters
    (CPU index_add_ on bf16 costs more than the matmuls)."""
    for slot, start, end in segments:
        view = views[slot]
        if view is not None:
            y[start:end].addmm_(torch.mm(x[start:end], view[0]), view[1])
    return y
