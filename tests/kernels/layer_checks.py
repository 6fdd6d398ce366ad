"""The fused layer ops' checks against the eager torch code they replace, shared by their CPU
tests (test_layer_ops.py, cpu_kernels) and CUDA tests (test_layer_kernel.py, cupy_kernels)."""

from __future__ import annotations

import torch

ULP = {torch.bfloat16: 2 ** -7, torch.float16: 2 ** -10}  # relative, at 1.0


def assert_matches_eager(out: torch.Tensor, ref: torch.Tensor, max_ulps: int = 1) -> None:
    """float32: equal up to a reduction order or an exp's last bits. 16-bit: almost always
    equal, else at most `max_ulps` apart."""
    assert out.dtype == ref.dtype and out.shape == ref.shape
    assert torch.isfinite(out).all()
    if out.dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=2e-6, atol=1e-6)
    else:
        torch.testing.assert_close(out.float(), ref.float(), rtol=max_ulps * ULP[out.dtype], atol=1e-5)
        assert (out == ref).float().mean() > 0.99


def pair(module, kernels, *args):
    """(result through `kernels`, eager result) of one module, each on copies of the inputs."""
    module.kernels = kernels
    fused = module(*[a.clone() if isinstance(a, torch.Tensor) else a for a in args])
    module.kernels = None
    return fused, module(*[a.clone() if isinstance(a, torch.Tensor) else a for a in args])


def randn(*shape, dtype=torch.float32, seed=0, device="cpu"):
    return torch.randn(*shape, device=device, generator=torch.Generator(device).manual_seed(seed)).to(dtype)
