"""CupyAttentionBackend against TorchAttentionBackend through the engine's interface:
int64 metadata as the runner builds it, decodes and prefill chunks in one step."""

from __future__ import annotations

import pytest
import torch

from gpu_skip import pytestmark  # noqa: F401  (skips this module without a GPU)
from kernel_inputs import TOLERANCE, mixed_step, relative_error
from engine.attention import get_attention_backend


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
        meta = mixed_step(block_size, num_blocks, torch.Generator().manual_seed(1), "cuda")
        num_tokens = meta.slot_mapping.numel()
        fused = torch.randn(num_tokens, heads + 2 * kv_heads, dim, device="cuda").to(dtype)
        q, k, v = fused.split([heads, kv_heads, kv_heads], dim=1)
        backend.prepare(meta)
        outs.append(backend.forward(q, k, v, cache, meta).float())
        caches.append(cache)
    assert torch.equal(caches[0], caches[1])
    assert relative_error(outs[1], outs[0]) <= 2 * TOLERANCE[dtype]  # both round to dtype
