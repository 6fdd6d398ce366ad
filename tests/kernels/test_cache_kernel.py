"""reshape_and_cache against its reference: strided K/V views, shuffled slots, padding rows; and
into an fp8 cache, bit for bit against the cache format's quantizer (engine/attention/kv_format.py)."""

from __future__ import annotations

import pytest
import torch

from gpu_skip import pytestmark  # noqa: F401  (skips this module without a GPU)
from kernel_inputs import DTYPES, FP8_IDS, strided_qkv
from cupy_kernels import ops, reference
from engine.attention.kv_format import KvCacheFormat


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_size", [64, 96, 128])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("num_tokens", [1, 7, 300])
def test_reshape_and_cache(dtype, head_size, block_size, num_tokens):
    gen = torch.Generator("cuda").manual_seed(num_tokens)
    num_kv_heads, num_blocks = 4, 40
    _, k, v = strided_qkv(num_tokens, 8, num_kv_heads, head_size, dtype, gen)
    cache = torch.randn((2, num_kv_heads, num_blocks, block_size, head_size), device="cuda",
                        generator=gen).to(dtype)
    slots = torch.randperm(num_blocks * block_size, device="cuda", generator=gen)[:num_tokens].to(torch.int32)
    slots[::5] = -1  # padding rows: written nowhere
    expected = reference.reshape_and_cache(k, v, cache, slots)
    ops.reshape_and_cache(k, v, cache, slots)
    torch.cuda.synchronize()
    assert torch.equal(cache.view(torch.uint8), expected.view(torch.uint8))


@pytest.mark.parametrize("dtype", DTYPES, ids=FP8_IDS)
@pytest.mark.parametrize("head_size", [64, 96, 128])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("num_tokens", [1, 7, 300])
def test_reshape_and_cache_fp8(dtype, head_size, block_size, num_tokens):
    """Values across e4m3's whole range: rows scaled by 2^-14 .. 2^12, so that some saturate
    (|x| > 448), some are subnormal (< 2^-6) and some round to zero; ties fall where they may."""
    gen = torch.Generator("cuda").manual_seed(num_tokens)
    num_kv_heads, num_blocks = 4, 40
    _, k, v = strided_qkv(num_tokens, 8, num_kv_heads, head_size, dtype, gen)
    for x in (k, v):  # in place: k and v stay strided views of the fused projection
        x.mul_(2.0 ** torch.randint(-14, 13, (num_tokens, 1, 1), device="cuda", generator=gen).to(dtype))
    cache = torch.randn((2, num_kv_heads, num_blocks, block_size, head_size), device="cuda",
                        generator=gen).to(torch.float8_e4m3fn)
    slots = torch.randperm(num_blocks * block_size, device="cuda", generator=gen)[:num_tokens].to(torch.int32)
    slots[::5] = -1
    fmt = KvCacheFormat("fp8", dtype)
    expected = reference.reshape_and_cache(fmt.quantize_rows(k), fmt.quantize_rows(v), cache, slots)
    ops.reshape_and_cache(k, v, cache, slots)
    torch.cuda.synchronize()
    assert torch.equal(cache.view(torch.uint8), expected.view(torch.uint8))
