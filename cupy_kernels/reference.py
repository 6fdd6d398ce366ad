"""Plain-torch references for each kernel, in float32, written for clarity over speed.

Tests compare the kernels against these. Each gathers a sequence's keys position by
position through its block table, so it shares no indexing code with the kernels.
"""

from __future__ import annotations

import torch


def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                      slot_mapping: torch.Tensor) -> torch.Tensor:
    """A copy of kv_cache [2, Hkv, N, bs, D] with row t of key/value [T, Hkv, D] written at
    slot_mapping[t] (skipped when negative)."""
    out = kv_cache.clone()
    block_size = kv_cache.shape[3]
    for t, slot in enumerate(slot_mapping.tolist()):
        if slot >= 0:
            out[0, :, slot // block_size, slot % block_size] = key[t]
            out[1, :, slot // block_size, slot % block_size] = value[t]
    return out


def gather_context(kv_cache: torch.Tensor, block_table: list[int], length: int
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of positions 0..length-1 of one sequence: two float32 [Hkv, length, D]."""
    block_size = kv_cache.shape[3]
    blocks = torch.tensor([block_table[p // block_size] for p in range(length)], dtype=torch.long,
                          device=kv_cache.device)
    offsets = torch.arange(length, device=kv_cache.device) % block_size
    k = kv_cache[0][:, blocks, offsets].float()
    v = kv_cache[1][:, blocks, offsets].float()
    return k, v


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, q_positions: torch.Tensor
           ) -> torch.Tensor:
    """q [n, Hq, D] at absolute q_positions [n] over k/v [Hkv, L, D]; causal by position.
    Returns float32 [n, Hq, D]; a row that sees no key is zero."""
    n, num_q_heads, head_size = q.shape
    group = num_q_heads // k.shape[0]
    if k.shape[1] == 0:
        return torch.zeros(n, num_q_heads, head_size, device=q.device)
    k = k.repeat_interleave(group, dim=0)  # [Hq, L, D]
    v = v.repeat_interleave(group, dim=0)
    scores = torch.einsum("nhd,hld->hnl", q.float(), k) * scale
    key_pos = torch.arange(k.shape[1], device=q.device)
    scores = scores.masked_fill(key_pos[None, None, :] > q_positions[None, :, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("hnl,hld->nhd", probs, v)


def paged_decode(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                 context_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """q [B, Hq, D]: each row attends to its sequence's context_lens[b] cached tokens."""
    out = []
    for b, length in enumerate(context_lens.tolist()):
        k, v = gather_context(kv_cache, block_tables[b].tolist(), length)
        position = torch.tensor([max(length - 1, 0)], device=q.device)
        out.append(attend(q[b:b + 1], k, v, scale, position))
    return torch.cat(out)


def paged_prefill(q: torch.Tensor, kv_cache: torch.Tensor, chunks: list[tuple[int, int, int]],
                  block_tables: list[list[int]], scale: float) -> torch.Tensor:
    """q [T, Hq, D]; chunks (token_start, num_tokens, context_len). Rows of each chunk
    attend causally over its context; rows outside every chunk stay zero."""
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    for (start, num_tokens, context_len), table in zip(chunks, block_tables):
        k, v = gather_context(kv_cache, table, context_len)
        positions = torch.arange(context_len - num_tokens, context_len, device=q.device)
        out[start:start + num_tokens] = attend(q[start:start + num_tokens], k, v, scale, positions)
    return out
