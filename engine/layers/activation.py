"""The gated MLPs' activations on [gate | up]: SiLU-and-mul (silu(gate) * up), GeGLU, and
gpt-oss's clamped SwiGLU."""

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


class ClampedSwiGLU(Layer):
    """gpt-oss's activation on [N, 2I] (gate columns, then up): [N, I]. Fused on CPU
    (cpu_kernels' clamped_swiglu: seven bf16 passes over the experts' rows in one)."""

    kernels = None  # as SiluAndMul's; only CPU kernels have it (CUDA runs eager)

    def __init__(self, alpha: float, limit: float) -> None:
        super().__init__()
        self.alpha, self.limit = alpha, limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernels is not None:
            return self.kernels.clamped_swiglu(x, self.alpha, self.limit)
        gate, up = x.chunk(2, dim=-1)
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))
