"""CupyAttentionBackend against TorchAttentionBackend through the engine's interface:
int64 metadata as the runner builds it, decodes and prefill chunks in one step."""

from __future__ import annotations

import pytest
import torch

from gpu_skip import pytestmark  # noqa: F401  (skips this module without a GPU)
from kernel_inputs import TOLERANCE, relative_error
from engine.attention import AttentionMetadata, PrefillChunk, get_attention_backend


def step_metadata(block_size: int, num_blocks: int, gen: torch.Generator) -> AttentionMetadata:
    """Three decodes (contexts 1, 40, 700) then two chunks: 20 new over 30 cached, 9 fresh."""
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    decode_lens, chunks = [1, 40, 700], [(20, 50), (9, 9)]
    tables = []
    for n in decode_lens + [c for _, c in chunks]:
        count = -(-n // block_size)
        tables.append(perm[:count])
        perm = perm[count:]
    slots, prefills, row = [], [], len(decode_lens)
    for n, table in zip(decode_lens, tables):
        slots.append(table[(n - 1) // block_size] * block_size + (n - 1) % block_size)
    for (new, context), table in zip(chunks, tables[len(decode_lens):]):
        slots += [table[p // block_size] * block_size + p % block_size for p in range(context - new, context)]
        prefills.append(PrefillChunk(row, new, context, torch.tensor(table, device="cuda")))
        row += new
    width = max(len(t) for t in tables[:3])
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, device="cuda"), num_decode_tokens=3,
        decode_block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables[:3]], device="cuda"),
        decode_context_lens=torch.tensor(decode_lens, device="cuda"), prefills=prefills,
        backend_state={"block_size": block_size})


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [16, 32])
def test_matches_torch_backend(dtype, block_size):
    gen = torch.Generator().manual_seed(block_size)
    heads, kv_heads, dim, num_blocks = 16, 4, 128, 200
    outs, caches = [], []
    for name in ("torch", "cupy"):
        backend = get_attention_backend(name, heads, kv_heads, dim, "cuda")
        torch.manual_seed(0)
        cache = torch.randn(backend.kv_cache_shape(num_blocks, block_size), device="cuda").to(dtype)
        meta = step_metadata(block_size, num_blocks, torch.Generator().manual_seed(1))
        num_tokens = meta.slot_mapping.numel()
        fused = torch.randn(num_tokens, heads + 2 * kv_heads, dim, device="cuda").to(dtype)
        q, k, v = fused.split([heads, kv_heads, kv_heads], dim=1)
        backend.prepare(meta)
        outs.append(backend.forward(q, k, v, cache, meta).float())
        caches.append(cache)
    assert torch.equal(caches[0], caches[1])
    assert relative_error(outs[1], outs[0]) <= 2 * TOLERANCE[dtype]  # both round to dtype
