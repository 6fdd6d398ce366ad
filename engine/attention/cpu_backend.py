"""Paged attention on CPU with a C++ decode kernel (cpu_kernels/csrc/paged_attention.cpp).

Same cache layout as the torch backend, whose cache writes and prefill path it keeps:

    kv_cache: [2, Hkv, num_blocks, block_size, row]
               ^ 0 = K, 1 = V    row = D values, or D int8 values + a bf16 scale (--kv-cache-dtype int8)

New K/V go into the cache through `cpu_kernels.ops.reshape_and_cache`, and decode rows
through `paged_decode`, which reads each sequence's blocks in place through its block
table: no gather copy, no padding of the batch or of the table width to buckets, no mask.
A step of decodes alone is those two calls. The kernels cover float32 and bfloat16
caches, and int8 ones (csrc/paged_attention_int8.cpp: quantized on write, dequantized in
registers); a float16 or fp8 cache runs the torch path (which quantizes and dequantizes fp8).

Sliding windows: `paged_decode` takes the layer's window and starts each row's key loop
at the window's first position, so it never reads the blocks before it; prefill chunks
take the torch backend's windowed path (their tables sliced at the first visible block).
Attention sinks (gpt-oss): `paged_decode` adds each head's sink to its denominator; prefill
chunks take the torch backend's path with sinks.
"""

from __future__ import annotations

import torch

from cpu_kernels import ops
from engine.attention.base import AttentionMetadata
from engine.attention.kv_format import KvCacheFormat
from engine.attention.torch_backend import TorchAttentionBackend


class CpuAttentionBackend(TorchAttentionBackend):
    name = "cpu"

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int,
                 kv_format: KvCacheFormat | None = None) -> None:
        if head_dim % 8:
            raise ValueError(f"attention_backend 'cpu': head size {head_dim} is not a multiple of 8; use 'torch'")
        if kv_format is not None and kv_format.name == "int8" and not ops.int8_kv_available():
            raise ValueError("attention_backend 'cpu': the int8 KV cache's kernels (paged_attention_int8) are "
                             "unavailable here; use --attention-backend torch or --kv-cache-dtype auto")
        super().__init__(num_heads, num_kv_heads, head_dim, kv_format)

    def prepare(self, meta: AttentionMetadata) -> None:
        if meta.num_decode_tokens:
            meta.backend_state["decode"] = (meta.decode_block_tables.contiguous(),
                                            meta.decode_context_lens.contiguous())
        meta.backend_state["prefill_masks"] = self._prefill_masks(meta)

    def _decode(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                sinks: torch.Tensor | None = None) -> torch.Tensor:
        if kv_cache.dtype not in ops.KV_CACHE_DTYPES:
            if "decode_plan" not in meta.backend_state:  # once per step: all layers share it
                self._prepare_decode(meta)
            return super()._decode(q, kv_cache, meta, sinks)
        tables, lens = meta.backend_state["decode"]
        return ops.paged_decode(q, kv_cache, tables, lens, self.scale, sinks=_float32(sinks))

    def _attend(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                window: int | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        if window is None or kv_cache.dtype not in ops.KV_CACHE_DTYPES:
            return super()._attend(q, kv_cache, meta, window, sinks)
        num_decode = meta.num_decode_tokens
        prefills = AttentionMetadata(meta.slot_mapping, 0, None, None, meta.prefills, meta.backend_state)
        out = super()._attend(q, kv_cache, prefills, window, sinks)  # decode rows left as they came
        if num_decode:
            tables, lens = meta.backend_state["decode"]
            out[:num_decode] = ops.paged_decode(q[:num_decode], kv_cache, tables, lens, self.scale, window,
                                                _float32(sinks))
        return out

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, sliding_window: int | None = None,
                sinks: torch.Tensor | None = None) -> torch.Tensor:
        if kv_cache.dtype not in ops.KV_CACHE_DTYPES:
            return super().forward(q, k, v, kv_cache, meta, sliding_window, sinks)
        ops.reshape_and_cache(k, v, kv_cache, meta.slot_mapping)
        if meta.prefills or meta.num_decode_tokens != q.shape[0]:  # chunks, or padding rows
            return self._attend(q, kv_cache, meta, sliding_window, sinks)
        tables, lens = meta.backend_state["decode"]
        return ops.paged_decode(q, kv_cache, tables, lens, self.scale, sliding_window, _float32(sinks))


def _float32(sinks: torch.Tensor | None) -> torch.Tensor | None:
    """The kernel's sinks: contiguous float32 (a bfloat16 model's parameter is widened, exactly)."""
    return None if sinks is None else sinks.float().contiguous()
