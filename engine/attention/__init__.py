"""Attention backends: how K/V are written to and read from the paged cache.

The model calls `AttentionBackend.forward` and nothing else, so a backend (the torch
reference, C++ kernels on CPU, CuPy kernels on GPU) plugs in without touching models. The
interface and a step's metadata are engine/attention/base.py's; `get_attention_backend` picks
a backend.
"""

from __future__ import annotations

import torch

from engine.attention.base import AttentionBackend, AttentionMetadata, PrefillChunk
from engine.attention.kv_format import KvCacheFormat

__all__ = ["AttentionBackend", "AttentionMetadata", "PrefillChunk", "get_attention_backend"]


def get_attention_backend(name: str, num_heads: int, num_kv_heads: int, head_dim: int, device: str,
                          dtype: torch.dtype = torch.float32, kv_format: KvCacheFormat | None = None
                          ) -> AttentionBackend:
    """The backend `name` ("auto": the CPU kernels on a CPU device, the CUDA kernels on a
    CUDA one, where they are available and fit the head size; else torch) for a model on
    `device`. Every backend runs sliding windows and attention sinks. `dtype`: the KV
    cache's, which picks the CUDA kernels' variants (tensor cores for fp16/bf16). `kv_format`:
    the cache's storage (--kv-cache-dtype; None: the model's dtype); an int8 cache on CUDA runs
    the torch backend under "auto" (the CUDA kernels' quantized format is fp8)."""
    on_cpu = torch.device(device).type == "cpu"
    kv_format = kv_format or KvCacheFormat("auto", dtype)
    if name == "auto" and not on_cpu and kv_format.name == "int8":
        name = "torch"
    if name == "auto" and on_cpu:
        import cpu_kernels
        from cpu_kernels.ops import int8_kv_available
        # available() builds the kernels on first use; a failed build logs one warning.
        fits = head_dim % 8 == 0 and (kv_format.name != "int8" or int8_kv_available())
        name = "cpu" if fits and cpu_kernels.available("paged_attention") else "torch"
    elif name == "auto":
        import cupy_kernels
        from cupy_kernels.compile import HEAD_SIZES
        name = "cupy" if head_dim in HEAD_SIZES and cupy_kernels.available() else "torch"
    if name == "cpu":
        import cpu_kernels
        if not on_cpu:
            raise ValueError(f"attention_backend 'cpu' runs CPU kernels; the model is on {device!r}")
        reason = cpu_kernels.unavailable_reason("paged_attention")
        if reason is not None:
            raise ValueError(f"attention_backend 'cpu' needs the C++ attention kernel, which is unavailable: "
                             f"{reason.rstrip('.')}; use 'torch' (or 'auto', which falls back to it)")
        from engine.attention.cpu_backend import CpuAttentionBackend
        return CpuAttentionBackend(num_heads, num_kv_heads, head_dim, kv_format)
    if name == "torch":
        from engine.attention.torch_backend import TorchAttentionBackend
        return TorchAttentionBackend(num_heads, num_kv_heads, head_dim, kv_format)
    if name == "cupy":
        import cupy_kernels
        reason = cupy_kernels.unavailable_reason()
        if reason is not None:
            raise ValueError(f"attention_backend 'cupy' needs cupy and a CUDA GPU (sm_80+): {reason}; "
                             "install the gpu extra (pip install 'pagedserve[gpu]') or use 'torch'")
        from engine.attention.cupy_backend import CupyAttentionBackend
        return CupyAttentionBackend(num_heads, num_kv_heads, head_dim, dtype, kv_format=kv_format)
    raise ValueError(f"attention_backend: {name!r} is not available (available: auto, torch, cpu, cupy)")
