"""Dense bf16 layers on oneDNN's packed weights (engine/layers/packed_linear.py): the same bits
as F.linear at every row count, with and without a bias, on 3-D and strided inputs; the plain
weight is gone (no second copy); a tied head, float32 and quantized layers are left alone."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from engine.layers.packed_linear import PackedLinear, available, pack_dense_linears

pytestmark = pytest.mark.skipif(not available(), reason="torch without oneDNN, or a CPU it packs no bf16 for")


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(100, 64)
        self.proj = nn.Linear(64, 96, bias=True)
        self.down = nn.Linear(96, 64, bias=False)
        self.head = nn.Linear(64, 100, bias=False)
        self.head.weight = self.embed.weight  # tied
        self.fp32 = nn.Linear(64, 8).float()


@torch.no_grad()  # as the engine runs
def test_packed_layers_give_f_linear_bits_and_keep_one_copy():
    torch.manual_seed(0)
    model = Tiny().bfloat16()
    model.fp32.float()
    plain = {name: (m.weight.detach().clone(), None if m.bias is None else m.bias.detach().clone())
             for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    assert pack_dense_linears(model) == 2
    assert type(model.proj) is PackedLinear and type(model.down) is PackedLinear
    assert type(model.head) is nn.Linear and model.head.weight is model.embed.weight  # tied: left alone
    assert type(model.fp32) is nn.Linear
    assert model.proj.weight.layout == torch._mkldnn and model.proj.weight.shape == (96, 64)
    for rows in (1, 3, 32, 300):
        x = torch.randn(rows, 64).bfloat16()
        weight, bias = plain["proj"]
        assert torch.equal(model.proj(x), torch.nn.functional.linear(x, weight, bias)), rows
    x3 = torch.randn(2, 5, 96).bfloat16()
    assert torch.equal(model.down(x3), torch.nn.functional.linear(x3, plain["down"][0]))
    strided = torch.randn(7, 128).bfloat16()[:, ::2]
    assert torch.equal(model.proj(strided), torch.nn.functional.linear(strided, *plain["proj"]))
