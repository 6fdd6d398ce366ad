"""engine.models.loader.materialize: a model built on the meta device, given real (empty)
tensors without Module.to_empty's meta empty_like (which imports sympy)."""

from __future__ import annotations

import subprocess
import sys

import torch
from torch import nn

from engine.models.loader import materialize


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight
        self.norm = nn.LayerNorm(4)
        self.norm.weight.requires_grad_(False)
        self.register_buffer("table", torch.empty(3, 2, dtype=torch.float16), persistent=False)
        self.register_buffer("steps", torch.empty(2, dtype=torch.int64))


def test_every_tensor_leaves_meta_with_its_shape_dtype_and_ties():
    with torch.device("meta"):
        model = Tied()
    materialize(model, "cpu")
    tensors = [*model.parameters(), *model.buffers()]
    assert all(t.device.type == "cpu" for t in tensors)
    assert model.head.weight is model.embed.weight  # still one tensor
    assert isinstance(model.embed.weight, nn.Parameter) and model.embed.weight.shape == (10, 4)
    assert model.embed.weight.requires_grad and not model.norm.weight.requires_grad
    assert model.table.dtype == torch.float16 and model.table.shape == (3, 2)
    assert "table" not in model.state_dict() and "steps" in model.state_dict()  # persistence kept


def test_it_imports_no_sympy():
    """Module.to_empty's meta empty_like went through torch._refs, which imported sympy: a
    third of a second of every engine's start-up."""
    code = ("import sys, torch; from torch import nn; from engine.models.loader import materialize\n"
            "with torch.device('meta'): model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8))\n"
            "materialize(model, 'cpu'); print('sympy' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
