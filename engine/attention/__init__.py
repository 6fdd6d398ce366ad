"""Attention backends: how K/V are written to and read from the paged cache.

The model calls `AttentionBackend.forward` and nothing else, so a backend (the
torch reference here, C++ kernels on CPU, CuPy kernels on GPU) plugs in without
touching models.

A step's tokens are laid out flat, decodes first, then prefill chunks:

    tokens:  [d0 d1 d2 | p0 p0 p0 p0 | p1 p1 ]     T = num_decode + sum(chunk lengths)
              decodes    prefill #0    prefill #1
    slot_mapping[t] = block_table[pos // block_size] * block_size + pos % block_size

A block table row lists the physical blocks of one sequence, in order:

    block_tables[b] = [ 7, 2, 9, 0, 0 ]   (padded with 0; context_lens masks the tail)
                        ^ tokens 0..15, then 16..31 in block 2, ...

When every layer has a sliding window, entries wholly before a row's window may be
FREED_BLOCK (-1, released by the block manager): windowed attention never reads them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch


@dataclass
class PrefillChunk:
    """One sequence's chunk of new tokens, with the context it attends to."""

    token_start: int  # first row of this chunk in the flat token batch
    num_tokens: int  # new tokens in this chunk
    context_len: int  # cached + new tokens: what the last new token attends to
    block_table: torch.Tensor  # [ceil(context_len / block_size)] int64


@dataclass
class AttentionMetadata:
    """Everything a backend needs for one step; built once per step by the runner."""

    slot_mapping: torch.Tensor  # [T] int64: where each new token's K/V goes
    num_decode_tokens: int  # the first rows are single-token decodes
    decode_block_tables: torch.Tensor | None  # [num_decode, max_blocks] int64
    decode_context_lens: torch.Tensor | None  # [num_decode] int64
    prefills: list[PrefillChunk] = field(default_factory=list)
    backend_state: dict = field(default_factory=dict)  # a backend's per-step precomputation


class AttentionBackend(Protocol):
    """The interface every attention implementation provides."""

    name: str

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        """Shape of one layer's K+V cache tensor; the layout is the backend's choice."""
        ...

    def prepare(self, meta: AttentionMetadata) -> None:
        """Per-step precomputation shared by all layers (masks, index tensors)."""
        ...

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, sliding_window: int | None = None) -> torch.Tensor:
        """Write k/v ([T, Hkv, D]) into the cache, then attend q ([T, Hq, D]) -> [T, Hq, D].
        `sliding_window` W (None: full attention): a query at position i sees keys j with
        i - W < j <= i, and table entries for blocks wholly before i - W + 1 are never read."""
        ...

    def copy_blocks(self, kv_caches: list[torch.Tensor], pairs: list[tuple[int, int]]) -> None:
        """Copy whole blocks src -> dst in every layer (copy-on-write after a fork)."""
        ...


def get_attention_backend(name: str, num_heads: int, num_kv_heads: int, head_dim: int, device: str,
                          sliding_window: bool = False, dtype: torch.dtype = torch.float32) -> AttentionBackend:
    """The backend `name` ("auto": the CPU kernels on a CPU device, the CUDA kernels on a
    CUDA one, where they are available and fit the head size; else torch) for a model on
    `device`. `sliding_window`: some layer of the model is windowed, which the CUDA
    kernels do not do (so "auto" picks torch there, and "cupy" is refused). `dtype`: the
    KV cache's, which picks the CUDA kernels' variants (tensor cores for fp16/bf16)."""
    on_cpu = torch.device(device).type == "cpu"
    if name == "auto" and on_cpu:
        import cpu_kernels
        # available() builds the kernels on first use; a failed build logs one warning.
        fits = head_dim % 8 == 0
        name = "cpu" if fits and cpu_kernels.available("paged_attention") else "torch"
    elif name == "auto":
        import cupy_kernels
        from cupy_kernels.compile import HEAD_SIZES
        fits = head_dim in HEAD_SIZES and not sliding_window
        name = "cupy" if fits and cupy_kernels.available() else "torch"
    if name == "cpu":
        import cpu_kernels
        if not on_cpu:
            raise ValueError(f"attention_backend 'cpu' runs CPU kernels; the model is on {device!r}")
        reason = cpu_kernels.unavailable_reason("paged_attention")
        if reason is not None:
            raise ValueError(f"attention_backend 'cpu' needs the C++ attention kernel, which is unavailable: "
                             f"{reason.rstrip('.')}; use 'torch' (or 'auto', which falls back to it)")
        from engine.attention.cpu_backend import CpuAttentionBackend
        return CpuAttentionBackend(num_heads, num_kv_heads, head_dim)
    if name == "torch":
        from engine.attention.torch_backend import TorchAttentionBackend
        return TorchAttentionBackend(num_heads, num_kv_heads, head_dim)
    if name == "cupy":
        if sliding_window:
            raise ValueError("attention_backend 'cupy' does not implement sliding-window attention, which "
                             "this model uses; use 'torch' (or 'auto', which picks it)")
        import cupy_kernels
        reason = cupy_kernels.unavailable_reason()
        if reason is not None:
            raise ValueError(f"attention_backend 'cupy' needs cupy and a CUDA GPU (sm_80+): {reason}; "
                             "install the gpu extra (pip install 'pagedserve[gpu]') or use 'torch'")
        from engine.attention.cupy_backend import CupyAttentionBackend
        return CupyAttentionBackend(num_heads, num_kv_heads, head_dim, dtype)
    raise ValueError(f"attention_backend: {name!r} is not available (available: auto, torch, cpu, cupy)")
