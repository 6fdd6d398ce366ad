"""CupyAttentionBackend against TorchAttentionBackend through the engine's interface:
int64 metadata as the runner builds it, decodes and prefill chunks in one step. Prefill
chunks go through FlashAttention (fp16/bf16) or cupy_kernels' paged_prefill (fp32, or
PAGEDSERVE_CUPY_PREFILL=paged), decodes through paged_decode or, with
PAGEDSERVE_CUPY_DECODE=mma, the tensor-core paged_decode_mma (fp16/bf16): all are checked, over a
cache in the model's dtype and over an fp8 one (--kv-cache-dtype fp8), where the two
backends must write the same bytes."""

from __future__ import annotations

import pytest
import torch

from gpu_skip import pytestmark  # noqa: F401  (skips this module without a GPU)
from kernel_inputs import TOLERANCE, mixed_step, relative_error
from engine.attention import get_attention_backend
from engine.attention.flash_prefill import FlashPrefillPlan
from engine.attention.kv_format import KvCacheFormat

# (new tokens, context): cached prefixes, fresh prompts, one token over a long prefix.
CHUNKS = ((20, 50), (9, 9), (300, 300), (1, 700), (64, 1000))


@pytest.mark.parametrize("decode", ["simt", "mma"])
@pytest.mark.parametrize("prefill", ["flash", "paged"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("attention", ["plain", "window_sinks"])
def test_matches_torch_backend(dtype, block_size, prefill, decode, attention, monkeypatch):
    """`window_sinks`: gpt-oss's attention, a 128-token window (shorter than most contexts
    here) and a random sink per query head."""
    check_backends(dtype, block_size, prefill, decode, attention, monkeypatch)


@pytest.mark.parametrize("decode", ["simt", "mma"])
@pytest.mark.parametrize("prefill", ["flash", "paged"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("attention", ["plain", "window_sinks"])
def test_fp8_cache_matches_torch_backend(dtype, block_size, prefill, decode, attention, monkeypatch):
    check_backends(dtype, block_size, prefill, decode, attention, monkeypatch, KvCacheFormat("fp8", dtype))


def check_backends(dtype, block_size, prefill, decode, attention, monkeypatch, kv_format=None):
    monkeypatch.setenv("PAGEDSERVE_CUPY_PREFILL", prefill)
    monkeypatch.setenv("PAGEDSERVE_CUPY_DECODE", decode)
    heads, kv_heads, dim, num_blocks = 16, 4, 128, 400
    storage = dtype if kv_format is None else kv_format.storage_dtype
    outs, caches = [], []
    for name in ("torch", "cupy"):
        backend = get_attention_backend(name, heads, kv_heads, dim, "cuda", dtype=dtype, kv_format=kv_format)
        torch.manual_seed(0)
        cache = torch.randn(backend.kv_cache_shape(num_blocks, block_size), device="cuda").to(storage)
        meta = mixed_step(block_size, num_blocks, torch.Generator().manual_seed(1), "cuda", CHUNKS)
        num_tokens = meta.slot_mapping.numel()
        fused = torch.randn(num_tokens, heads + 2 * kv_heads, dim, device="cuda").to(dtype)
        q, k, v = fused.split([heads, kv_heads, kv_heads], dim=1)
        extra = {}
        if attention == "window_sinks":
            extra = {"sliding_window": 128, "sinks": torch.randn(heads, device="cuda",
                                                                 generator=torch.Generator("cuda").manual_seed(2))}
        backend.prepare(meta)
        outs.append(backend.forward(q, k, v, cache, meta, **extra).float())
        caches.append(cache)
    sixteen_bits = dtype != torch.float32
    plans = meta.backend_state["prefill"]
    assert isinstance(plans[None], FlashPrefillPlan) == (prefill == "flash" and sixteen_bits)
    assert set(plans) == ({None, 128} if attention == "window_sinks" else {None})
    assert meta.backend_state["decode"][2].tensor_cores == (decode == "mma" and sixteen_bits)
    assert caches[1].dtype == storage
    assert torch.equal(caches[0].view(torch.uint8), caches[1].view(torch.uint8))  # the same bytes written
    assert relative_error(outs[1], outs[0]) <= 2 * TOLERANCE[dtype]  # both round to dtype
