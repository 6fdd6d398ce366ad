"""reshape_and_cache against its reference: strided K/V views, shuffled slots, padding rows."""

from __future__ import annotations

import pytest
import torch

from gpu_skip import pytestmark  # noqa: F401  (skips this module without a GPU)
from kernel_inputs import DTYPES, strided_qkv
from cupy_kernels import ops, reference


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
