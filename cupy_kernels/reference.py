"""Plain-torch references for each kernel, in float32, written for clarity over speed.

Tests compare the kernels against these. Each gathers a sequence's keys position by
position through its block table, so it shares no indexing code with the kernels. An fp8
cache (float8_e4m3fn) is read through torch's own e4m3 -> float32 conversion, not the
kernels' (csrc/fp8.cuh); its writes are the cache format's quantizer (kv_format.py), which a
test applies before `reshape_and_cache` here.
"""

from __future__ import annotations

import torch


def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                      slot_mapping: torch.Tensor) -> torch.Tensor:
    """A copy of kv_cache [2, Hkv, N, bs, D] with row t of key/value [T, Hkv, D] written at
    slot_mapping[t] (skipped when negative). Rows go in as they are: for an fp8 cache, pass
    them quantized already."""
    out = kv_cache.clone()
    block_size = kv_cache.shape[3]
    for t, slot in enumerate(slot_mapping.tolist()):
        if slot >= 0:
            out[0, :, slot // block_size, slot % block_size] = key[t]
            out[1, :, slot // block_size, slot % block_size] = value[t]
    return out


def gather_context(kv_cache: torch.Tensor, block_table: list[int], length: int, first: int = 0
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of positions first..length-1 of one sequence: two float32 [Hkv, length - first, D]."""
    block_size = kv_cache.shape[3]
    blocks = torch.tensor([block_table[p // block_size] for p in range(first, length)], dtype=torch.long,
                          device=kv_cache.device)
    offsets = torch.arange(first, length, device=kv_cache.device) % block_size
    fp8 = kv_cache.dtype == torch.float8_e4m3fn
    cache = kv_cache.view(torch.uint8) if fp8 else kv_cache  # indexing kernels need not cover float8
    k, v = cache[0][:, blocks, offsets], cache[1][:, blocks, offsets]
    if fp8:
        k, v = k.view(torch.float8_e4m3fn), v.view(torch.float8_e4m3fn)
    return k.float(), v.float()


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, q_positions: torch.Tensor,
           window: int | None = None, sinks: torch.Tensor | None = None, first: int = 0) -> torch.Tensor:
    """q [n, Hq, D] at absolute q_positions [n] over k/v [Hkv, L, D] of positions first..;
    causal by position (and only the last `window` positions up to the query's with a sliding
    window); `sinks` [Hq]: one more logit per head in the softmax, whose probability is
    dropped. Returns float32 [n, Hq, D]; a row that sees no key is zero."""
    n, num_q_heads, head_size = q.shape
    group = num_q_heads // k.shape[0]
    if k.shape[1] == 0:
        return torch.zeros(n, num_q_heads, head_size, device=q.device)
    k = k.repeat_interleave(group, dim=0)  # [Hq, L, D]
    v = v.repeat_interleave(group, dim=0)
    scores = torch.einsum("nhd,hld->hnl", q.float(), k) * scale
    key_pos = torch.arange(first, first + k.shape[1], device=q.device)
    hidden = key_pos[None, None, :] > q_positions[None, :, None]
    if window:
        hidden |= key_pos[None, None, :] <= q_positions[None, :, None] - window
    scores = scores.masked_fill(hidden, float("-inf"))
    if sinks is not None:
        column = sinks.float().to(q.device)[:, None, None].expand(num_q_heads, n, 1)
        probs = torch.softmax(torch.cat([scores, column], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    return torch.einsum("hnl,hld->nhd", probs, v)


def paged_decode(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                 context_lens: torch.Tensor, scale: float, window: int | None = None,
                 sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q [B, Hq, D]: each row attends to its sequence's context_lens[b] cached tokens (the
    last `window`; `sinks` as `attend`'s)."""
    out = []
    for b, length in enumerate(context_lens.tolist()):
        first = max(0, length - window) if window else 0  # blocks before it may be released
        k, v = gather_context(kv_cache, block_tables[b].tolist(), length, first)
        position = torch.tensor([max(length - 1, 0)], device=q.device)
        out.append(attend(q[b:b + 1], k, v, scale, position, window, sinks, first))
    return torch.cat(out)


def paged_prefill(q: torch.Tensor, kv_cache: torch.Tensor, chunks: list[tuple[int, int, int]],
                  block_tables: list[list[int]], scale: float, window: int | None = None,
                  sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q [T, Hq, D]; chunks (token_start, num_tokens, context_len). Rows of each chunk
    attend causally over its context (`window`, `sinks` as `attend`'s); rows outside every
    chunk stay zero."""
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    for (start, num_tokens, context_len), table in zip(chunks, block_tables):
        first = max(0, context_len - num_tokens - window + 1) if window else 0  # the first query's window
        k, v = gather_context(kv_cache, table, context_len, first)
        positions = torch.arange(context_len - num_tokens, context_len, device=q.device)
        out[start:start + num_tokens] = attend(q[start:start + num_tokens], k, v, scale, positions, window, sinks,
                                               first)
    return out
