"""SiLU-and-mul, the gated MLP's activation: [gate | up] -> silu(gate) * up."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from cpu_kernels import ops
from engine.layers import Layer


class SiluAndMul(Layer):
    use_kernel = False  # set by engine.models.loader.use_layer_kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.use_kernel:
            return ops.silu_and_mul(x)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up


class GeluAndMul(Layer):
    """GeGLU, Gemma's gated MLP: [gate | up] -> gelu_tanh(gate) * up (HF's gelu_pytorch_tanh)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up
