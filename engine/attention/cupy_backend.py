"""CuPy-kernel paged attention on CUDA (fp32, fp16, bf16; head sizes 64/96/128;
block sizes 16/32), with sliding windows (Gemma 3, Mistral, gpt-oss: keys before a window
are never read, as the block manager may release their blocks) and attention sinks
(gpt-oss: one more logit per query head in each softmax, carrying no value).

Same cache layout as the torch reference, so either backend reads the other's cache:

    kv_cache: [2, Hkv, num_blocks, block_size, D]
               ^ 0 = K, 1 = V

`prepare` runs once per step: int32 copies of the runner's metadata, the decode plan
(single pass or split-K, see cupy_kernels.ops.plan_decode) and the prefill plan: for fp16
and bf16, FlashAttention's varlen layout over the chunks' contexts gathered from the cache
(engine/attention/flash_prefill.py, tensor cores; a windowed layer's plan, which gathers only
the windows, is made by its first layer of the step); for fp32, the tile map of cupy_kernels'
`paged_prefill`. `forward` then costs one reshape_and_cache launch plus one or two
attention launches per layer (and the gather). Windows and sinks are kernel arguments, so
a captured decode graph keeps them.

Decode runs `paged_decode` (decode.cu, CUDA cores) by default; `PAGEDSERVE_CUPY_DECODE=mma`
runs the tensor-core `paged_decode_mma` (decode_mma.cu) for fp16/bf16 caches instead, until
a GPU measurement picks the default (docs/kernels.md).

--kv-cache-dtype fp8: the same layout in float8_e4m3fn, one byte a value.
`reshape_and_cache` rounds each new value to e4m3; every read widens it back to the model's
dtype (the kernels as they stage tiles, FlashAttention's gather as it copies), so the kernels
and plans are the model dtype's. The int8 format (rows of D + 2 bytes) has no CUDA kernels.
"""

from __future__ import annotations

import os

import torch

from engine.attention.base import AttentionMetadata
from engine.attention.kv_format import KvCacheFormat
from engine.attention.flash_prefill import (FLASH_DTYPES, FlashPrefillPlan, flash_prefill,
                                            flash_prefill_enabled, plan_flash_prefill)
from engine.attention.torch_backend import copy_kv_blocks


class CupyAttentionBackend:
    name = "cupy"

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype = torch.float32,
                 kv_format: KvCacheFormat | None = None) -> None:
        from cupy_kernels import compile as kc
        if head_dim not in kc.HEAD_SIZES:
            raise ValueError(f"attention_backend 'cupy': head size {head_dim} is not supported "
                             f"(supported: {', '.join(map(str, kc.HEAD_SIZES))}); use 'torch'")
        check_kv_format(kv_format)
        self.kv_format = kv_format
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.group = num_heads // num_kv_heads
        self.scale = head_dim ** -0.5
        self.num_sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
        self.workspace: torch.Tensor | None = None  # split-K scratch, grown on demand
        self.flash_prefill = flash_prefill_enabled(dtype)
        self.decode_tensor_cores = (dtype in FLASH_DTYPES  # the 16-bit types, as decode_mma.cu's
                                    and os.environ.get("PAGEDSERVE_CUPY_DECODE", "simt") == "mma")

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        from cupy_kernels import compile as kc
        if block_size not in kc.BLOCK_SIZES:
            raise ValueError(f"attention_backend 'cupy': block_size {block_size} is not supported "
                             f"(supported: {', '.join(map(str, kc.BLOCK_SIZES))})")
        return (2, self.num_kv_heads, num_blocks, block_size, self.head_dim)

    def reserve_workspace(self, numel: int, device: torch.device) -> torch.Tensor:
        """At least `numel` float32 of split-K scratch. A CUDA graph keeps its own reference
        to the tensor it captured with, so growing it later cannot free that one."""
        if self.workspace is None or self.workspace.numel() < numel:
            self.workspace = torch.empty(numel, dtype=torch.float32, device=device)
        return self.workspace

    def prepare(self, meta: AttentionMetadata) -> None:
        from cupy_kernels import ops
        state = meta.backend_state
        state["slot_mapping"] = meta.slot_mapping.to(torch.int32)
        if meta.num_decode_tokens:
            tables = meta.decode_block_tables.to(torch.int32)
            # The padded table width bounds every context without reading lengths back.
            bound = tables.shape[1] * state["block_size"]
            plan = ops.plan_decode(meta.num_decode_tokens, self.num_kv_heads, self.group, bound, self.num_sms,
                                   self.decode_tensor_cores)
            numel = ops.decode_workspace_numel(meta.num_decode_tokens, self.num_heads, self.head_dim, plan)
            if numel:
                self.reserve_workspace(numel, tables.device)
            state["decode"] = (tables, meta.decode_context_lens.to(torch.int32), plan)
        if meta.prefills:
            plan = plan_flash_prefill(meta) if self.flash_prefill else None
            if plan is None:
                chunks = [(c.token_start, c.num_tokens, c.context_len) for c in meta.prefills]
                plan = ops.build_prefill_batch(chunks, meta.padded_prefill_tables(), self.group,
                                               meta.slot_mapping.device)
            state["prefill"] = {None: plan}  # by window: a windowed layer's flash plan is its own

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, sliding_window: int | None = None,
                sinks: torch.Tensor | None = None) -> torch.Tensor:
        from cupy_kernels import ops
        state = meta.backend_state
        ops.reshape_and_cache(k, v, kv_cache, state["slot_mapping"])
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        if sinks is not None and sinks.dtype != torch.float32:
            sinks = sinks.float()
        num_decode = meta.num_decode_tokens
        if num_decode:
            tables, lens, plan = state["decode"]
            ops.decode_attention(out[:num_decode], q[:num_decode], kv_cache, tables, lens, self.scale, plan,
                                 self.workspace, sliding_window, sinks)
        if meta.prefills:
            plan = self._prefill_plan(meta, sliding_window)
            if isinstance(plan, FlashPrefillPlan):
                flash_prefill(out, q, kv_cache, plan, self.scale, sliding_window, sinks)
            else:
                ops.prefill_attention(out, q, kv_cache, plan, self.scale, sliding_window, sinks)
        return out

    @staticmethod
    def _prefill_plan(meta: AttentionMetadata, window: int | None):
        """The step's prefill plan for a layer with this window: the paged kernel's takes the
        window as an argument; FlashAttention's gathers only the windows (made once a step)."""
        plans = meta.backend_state["prefill"]
        if window not in plans:
            full = plans[None]
            plans[window] = plan_flash_prefill(meta, window) if isinstance(full, FlashPrefillPlan) else full
        return plans[window]

    def copy_blocks(self, kv_caches: list[torch.Tensor], pairs: list[tuple[int, int]]) -> None:
        # The torch backend's cache layout; an fp8 cache is copied as its bytes (indexing
        # kernels need not cover float8 types).
        copy_kv_blocks([c.view(torch.uint8) if c.dtype == torch.float8_e4m3fn else c for c in kv_caches], pairs)


def check_kv_format(kv_format: KvCacheFormat | None) -> None:
    """Refuse the cache format the CUDA kernels do not read: int8 (the CPU kernels' rows of
    D + 2 bytes); fp8 is read under every model dtype."""
    if kv_format is not None and kv_format.name == "int8":
        raise ValueError("attention_backend 'cupy': kv_cache_dtype 'int8' has no CUDA kernels; on CUDA use "
                         "kv_cache_dtype 'fp8' (e4m3), or attention_backend 'torch', which reads int8 anywhere")
