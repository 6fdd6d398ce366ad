"""Plain-torch float32 references for the CPU kernels, written for clarity over speed."""

from __future__ import annotations

import torch

from cpu_kernels.fp8_format import Fp8Weight


def paged_decode(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                 context_lens: torch.Tensor, scale: float, window: int | None = None,
                 sinks: torch.Tensor | None = None) -> torch.Tensor:
    """float32 [B, Hq, D]: row b attends to positions 0..context_lens[b]-1 (the last
    `window` of them with a sliding window), each looked up
    through its block table, position by position (block = table[pos // bs], offset = pos % bs);
    `sinks` [Hq]: one more logit per head in the softmax, whose probability is dropped."""
    batch, num_heads, dim = q.shape
    num_kv_heads, block_size = kv_cache.shape[1], kv_cache.shape[3]
    group = num_heads // num_kv_heads
    out = torch.zeros(batch, num_heads, dim)
    for b in range(batch):
        table = block_tables[b].tolist()
        length = int(context_lens[b])
        positions = range(max(0, length - window) if window else 0, length)
        blocks = torch.tensor([table[pos // block_size] for pos in positions], dtype=torch.long)
        offsets = torch.tensor([pos % block_size for pos in positions], dtype=torch.long)
        for h in range(num_heads):
            keys = kv_cache[0, h // group][blocks, offsets].float()  # [L, D]
            values = kv_cache[1, h // group][blocks, offsets].float()
            scores = keys @ q[b, h].float() * scale
            if sinks is not None:
                scores = torch.cat([scores, sinks[h].float().reshape(1)])
            probs = torch.softmax(scores, dim=0)[:len(positions)]
            out[b, h] = probs @ values
    return out


def fp8_linear(x: torch.Tensor, weight: Fp8Weight) -> torch.Tensor:
    """float32 [M, N]: x as the kernel gets it (bfloat16 or float32) times the dequantized
    float32 weights, fp8.float() * scale, in float32 (the FP8 kernel's exactness reference)."""
    return x.float() @ weight.dequantize().t()
