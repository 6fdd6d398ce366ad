"""SiLU-and-mul, the gated MLP's activation: [gate | up] -> silu(gate) * up."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.layers import Layer


class SiluAndMul(Layer):
    kernels = None  # the fused ops' module (engine.models.loader.use_layer_kernels), or None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernels is not None:
            return self.kernels.silu_and_mul(x)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up


class GeluAndMul(Layer):
    """GeGLU, Gemma's gated MLP: [gate | up] -> gelu_tanh(gate) * up (HF's gelu_pytorch_tanh)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up
