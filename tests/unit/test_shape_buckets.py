"""CPU shape buckets (engine.cpu_tuning.bucket) and the padding they cause: padded rows and
padded decode tables must change nothing a real token sees."""

from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st

from cupy_kernels import reference
from engine.attention import AttentionMetadata
from engine.attention.torch_backend import TorchAttentionBackend
from engine.cpu_tuning import bucket


@given(st.integers(1, 1 << 20))
def test_bucket_pads_little_and_is_stable(n):
    b = bucket(n)
    assert n <= b <= n * 9 / 8  # at most 12.5% padding
    assert bucket(b) == b  # a bucket is its own bucket
    if n <= 16:
        assert b == n


def test_few_buckets():
    assert len({bucket(n) for n in range(1, 8193)}) <= 90


def test_padded_decode_equals_reference():
    torch.manual_seed(0)
    heads, kv_heads, dim, block_size, num_blocks = 4, 2, 16, 4, 64
    backend = TorchAttentionBackend(heads, kv_heads, dim)
    cache = torch.randn(backend.kv_cache_shape(num_blocks, block_size))
    batch, padding = 17, 3  # batch and width (17 blocks) both fall between buckets
    lens = torch.randint(1, 17 * block_size + 1, (batch,))
    tables = torch.stack([torch.randperm(num_blocks)[:17] for _ in range(batch)])
    slots = torch.stack([tables[i, (n - 1) // block_size] * block_size + (n - 1) % block_size
                         for i, n in enumerate(lens.tolist())])
    # Padding rows follow the real tokens, as the runner pads; they own no slot.
    q, k, v = (torch.randn(batch + padding, h, dim) for h in (heads, kv_heads, kv_heads))
    meta = AttentionMetadata(slot_mapping=slots, num_decode_tokens=batch, decode_block_tables=tables,
                             decode_context_lens=lens, backend_state={"block_size": block_size})
    expected_cache = reference.reshape_and_cache(k[:batch], v[:batch], cache, slots)
    backend.prepare(meta)
    assert tuple(meta.backend_state["decode_plan"][1]) == (bucket(batch), bucket(17))
    out = backend.forward(q, k, v, cache, meta)
    assert torch.equal(cache, expected_cache)  # padding rows wrote nothing
    expected = reference.paged_decode(q[:batch], cache, tables, lens, backend.scale)
    torch.testing.assert_close(out[:batch], expected, rtol=1e-5, atol=1e-5)
    assert out[batch:].abs().sum() == 0
