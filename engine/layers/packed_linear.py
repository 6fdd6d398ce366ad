"""Dense bfloat16 linear layers on CPU with their weights in oneDNN's own blocked layout.

F.linear hands oneDNN the plain [out, in] weight on every call, and at the few rows of a
decode step oneDNN then reads it at 15-20 GB/s on the 2-core VMs. The same weight reordered
once into oneDNN's layout (`torch.ops.mkldnn._reorder_linear_weight`, as torch.compile's CPU
backend does) reads at 25-40 GB/s: 1.6-2x faster at 1-4 rows (gpt-oss-20b's LM head: 18.0 ->
11.3 ms a token), no slower at more, and the same oneDNN kernels give the same bits as
F.linear at every row count (tests/unit/test_packed_linear.py).

The packed weight replaces the plain one (no second copy): a parameter of layout
torch._mkldnn, whose shape, dtype and device read as before but whose values only this
forward reads. So only plain nn.Linear layers whose weight no other module reads are packed:
not a head tied to the embedding, not the quantized layers (their own classes), not a model
that multiplies by its layers' weights itself (`PACKS_DENSE_LINEARS = False`: BERT's).
"""

from __future__ import annotations

import torch
from torch import nn


def available() -> bool:
    """oneDNN can pack bf16 weights here: its reorder refuses a CPU without AVX512-BW/VL/DQ or
    AVX-NE-CONVERT (an AVX2-only VM), where F.linear keeps the plain weight."""
    return (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and torch.ops.mkldnn._is_mkldnn_bf16_supported())


class PackedLinear(nn.Linear):
    """An nn.Linear whose weight is oneDNN-packed (made by `pack_dense_linears`)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        y = torch.ops.mkldnn._linear_pointwise(rows, self.weight, self.bias, "none", [], "")
        return y.view(*x.shape[:-1], self.out_features)


@torch.no_grad()
def pack_dense_linears(model: nn.Module) -> int:
    """Pack every plain bfloat16 CPU nn.Linear of `model` whose weight is its own; how many."""
    if not available() or not getattr(model, "PACKS_DENSE_LINEARS", True):
        return 0
    uses: dict[int, int] = {}
    for _, param in model.named_parameters(remove_duplicate=False):
        uses[id(param)] = uses.get(id(param), 0) + 1
    packed = 0
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if (type(module) is not nn.Linear or weight is None or weight.dtype != torch.bfloat16
                or weight.device.type != "cpu" or uses[id(weight)] > 1):
            continue
        module.weight = nn.Parameter(torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 1),
                                     requires_grad=False)
        module.__class__ = PackedLinear
        packed += 1
    return packed
