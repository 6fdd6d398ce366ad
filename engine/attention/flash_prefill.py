"""Prefill chunks on tensor cores: FlashAttention-2 (torch's build) over each chunk's context.

The cupy backend's own prefill kernel (`paged_prefill`) reads the paged cache in place but
does fp32 math on CUDA cores, one stage deep: fine for short prompts, slow for long ones.
For fp16/bf16 caches the backend instead gathers every chunk's context (cached prefix and
new tokens, already written) from the cache into one packed K/V, once per layer, and runs
one varlen FlashAttention call over all chunks of the step:

    q:   [ chunk 0's new rows | chunk 1's new rows | ... ]   cu_seq_q = [0, n0, n0 + n1, ...]
    k/v: [ chunk 0's context  | chunk 1's context  | ... ]   cu_seq_k = [0, c0, c0 + c1, ...]

Flash's causal mask is aligned to the bottom right when a chunk has fewer queries than
keys (torch.nn.attention.bias relies on the same), so new token i of a chunk whose context
is c sees keys 0 .. c - n + i: exactly the cached prefix plus the new tokens up to itself.
The gather costs one read and write of the contexts' K/V per layer, against the attention
itself reading them once per query tile.

Each chunk is one varlen sequence whose tiles start at its own first row, and the KV loop is
not split (num_splits=1 where torch exposes it), so a chunk's output does not depend on the
other chunks of its step.

A windowed layer (Gemma 3, Mistral, gpt-oss) gets a plan of its own per window: each chunk's
context starts at its first query's window (earlier blocks may be released, and are never
gathered), and flash masks the rest (window_size_left = window - 1). Attention sinks
(gpt-oss) scale each output row by sigmoid(lse - sink), from the log-sum-exp flash returns:
e^lse / (e^lse + e^sink) is the share the sink leaves the keys.

An fp8 cache (--kv-cache-dtype fp8) is widened to the query's dtype in the same gather (one
copy that converts: every e4m3 value is exactly an fp16 and a bf16 value), so flash sees the cache's
values as the kernels and the torch backend do.

`PAGEDSERVE_CUPY_PREFILL=paged` keeps every chunk on `paged_prefill` (an A/B switch for
`bench/gpu_session.sh`); float32 always takes it (FlashAttention has no fp32 path).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import torch

from engine.attention.base import AttentionMetadata

FLASH_DTYPES = (torch.float16, torch.bfloat16)


@dataclass
class FlashPrefillPlan:
    """One step's chunks as varlen sequences; built once per step, shared by the layers."""

    key_slots: torch.Tensor  # [total_k] int64: the cache slot of every context position, chunk by chunk
    cu_seq_q: torch.Tensor  # [C + 1] int32
    cu_seq_k: torch.Tensor  # [C + 1] int32
    max_q: int
    max_k: int
    first_row: int  # the chunks' rows of the flat token batch: first_row .. first_row + num_rows
    num_rows: int


def flash_prefill_enabled(dtype: torch.dtype) -> bool:
    """Whether chunks of this dtype go through FlashAttention (see the module's docstring)."""
    if dtype not in FLASH_DTYPES or os.environ.get("PAGEDSERVE_CUPY_PREFILL", "flash") == "paged":
        return False
    available = getattr(torch.backends.cuda, "is_flash_attention_available", None)
    return bool(available is not None and available())


def plan_flash_prefill(meta: AttentionMetadata, window: int | None = None) -> FlashPrefillPlan | None:
    """The varlen layout of the step's prefill chunks (with a sliding window, each context
    from its first query's window on); None where their rows are not one contiguous run (the
    runner lays them out so: after the decodes, in order)."""
    chunks, block_size = meta.prefills, meta.backend_state["block_size"]
    starts = np.array([c.token_start for c in chunks], dtype=np.int64)
    lens_q = np.array([c.num_tokens for c in chunks], dtype=np.int64)
    contexts = np.array([c.context_len for c in chunks], dtype=np.int64)
    first = np.maximum(0, contexts - lens_q - window + 1) if window else np.zeros_like(contexts)
    lens_k = contexts - first
    cu = np.zeros((2, len(chunks) + 1), dtype=np.int64)
    np.cumsum(lens_q, out=cu[0, 1:])
    np.cumsum(lens_k, out=cu[1, 1:])
    if not np.array_equal(starts - starts[0], cu[0, :-1]):
        return None
    total_k = int(cu[1, -1])
    # Each key's (chunk, position) on the host, then its slot through the tables on the device.
    chunk_of_key = np.repeat(np.arange(len(chunks)), lens_k)
    position = np.arange(total_k) - np.repeat(cu[1, :-1] - first, lens_k)
    tables = meta.padded_prefill_tables()
    device = tables.device
    index = torch.from_numpy(np.concatenate([chunk_of_key, position])).to(device, non_blocking=True)
    chunk_of_key, position = index[:total_k], index[total_k:]
    key_slots = tables[chunk_of_key, position // block_size] * block_size + position % block_size
    cu_dev = torch.from_numpy(cu.astype(np.int32)).to(device, non_blocking=True)
    return FlashPrefillPlan(key_slots, cu_dev[0], cu_dev[1], int(lens_q.max()), int(lens_k.max()),
                            int(starts[0]), int(cu[0, -1]))


def gather_contexts(kv_cache: torch.Tensor, plan: FlashPrefillPlan, dtype: torch.dtype | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunks' contexts from a [2, Hkv, num_blocks, block_size, D] cache as packed K and V,
    [total_k, Hkv, D] each (contiguous) in `dtype` (None: the cache's), in one index_select
    over K and V together and one copy (which converts an fp8 cache)."""
    two, heads, num_blocks, block_size, dim = kv_cache.shape
    fp8 = kv_cache.dtype == torch.float8_e4m3fn
    flat = kv_cache.view(torch.uint8) if fp8 else kv_cache  # the bytes, for index_select's sake
    both = flat.view(two, heads, num_blocks * block_size, dim).index_select(2, plan.key_slots)
    if fp8:
        both = both.view(torch.float8_e4m3fn)
    both = both.permute(0, 2, 1, 3)  # [2, total_k, Hkv, D]
    packed = torch.empty(both.shape, dtype=dtype or kv_cache.dtype, device=both.device).copy_(both)
    return packed[0], packed[1]


def flash_prefill(out: torch.Tensor, q: torch.Tensor, kv_cache: torch.Tensor, plan: FlashPrefillPlan,
                  scale: float, window: int | None = None, sinks: torch.Tensor | None = None) -> None:
    """The chunks' rows of out [T, Hq, D] = causal attention of q's rows over their contexts
    (CUDA, fp16/bf16; the new tokens' K/V are in the cache already). `window`: the plan's
    (plan_flash_prefill(meta, window)); `sinks` float32 [Hq]: see the module's docstring."""
    k, v = gather_contexts(kv_cache, plan, q.dtype)
    rows = slice(plan.first_row, plan.first_row + plan.num_rows)
    q = q[rows]
    if q.stride(-1) != 1:
        q = q.contiguous()
    windowed = {"window_size_left": window - 1, "window_size_right": 0} if window else {}
    result, lse = torch.ops.aten._flash_attention_forward(
        q, k, v, plan.cu_seq_q, plan.cu_seq_k, plan.max_q, plan.max_k, 0.0, True, False, scale=scale,
        **windowed, **_NO_SPLITS)[:2]
    out[rows] = result if sinks is None else with_sinks(result, lse, sinks)


def with_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """Attention rows out [n, H, D] computed without sinks, given each row's log-sum-exp of its
    scaled scores (flash's varlen layout, [H, n]), as if sinks [H] had joined each softmax:
    out * e^lse / (e^lse + e^sink) = out * sigmoid(lse - sink)."""
    share = torch.sigmoid(lse.float().t() - sinks.float())  # [n, H]; a row with no key: lse -inf, 0
    return (out.float() * share.unsqueeze(-1)).to(out.dtype)


# A KV loop split by the batch's shape would make a chunk's rounding depend on its neighbours.
_NO_SPLITS = ({"num_splits": 1}
              if "num_splits" in str(torch.ops.aten._flash_attention_forward.default._schema) else {})
