"""RMSNorm, computed exactly as Hugging Face's LlamaRMSNorm does (fp32 inside).

With a residual it is vLLM's fused form: `residual = x + residual`, then the norm of that,
returning both, so the decoder adds and normalises in one pass. `kernels` (set by
`engine.models.loader.use_layer_kernels`: cpu_kernels.ops or cupy_kernels.ops) routes it
through the fused ops.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.layers import Layer


class RMSNorm(Layer):
    kernels = None  # the fused ops' module, or None: eager torch (the reference)

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if self.kernels is not None:
            if residual is None:
                return self.kernels.rms_norm(x.reshape(-1, x.shape[-1]), self.weight, self.eps).view(x.shape)
            self.kernels.add_rms_norm(x, residual, self.weight, self.eps)  # in place: both are this step's
            return x, residual
        if residual is None:
            return self._norm(x)
        residual = x + residual
        return self._norm(residual), residual

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class GemmaRMSNorm(Layer):
    """Gemma's RMSNorm (HF's Gemma3RMSNorm): x * (1 + w), the product taken in float32
    before the cast back (Llama casts first). Weights are stored as w, centred on 0; the
    residual form is RMSNorm's."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return self._norm(x)
        residual = x + residual
        return self._norm(residual), residual

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x * (1.0 + self.weight.float())).to(dtype)
