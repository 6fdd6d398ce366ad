"""The kernel references themselves, on CPU: they must agree with the torch backend that
the engine's CPU path already checks against HF transformers."""

from __future__ import annotations

import torch

from cupy_kernels import reference
from engine.attention import AttentionMetadata, PrefillChunk
from engine.attention.torch_backend import TorchAttentionBackend


def mixed_step(seed: int):
    """(backend, cache, q, k, v, meta, prefill table): a torch backend over a random cache, and
    a step of two decodes (contexts 5 and 9), then a prefill chunk of 6 new tokens over 4 cached."""
    torch.manual_seed(seed)
    heads, kv_heads, dim, block_size, num_blocks = 8, 2, 32, 4, 24
    backend = TorchAttentionBackend(heads, kv_heads, dim)
    cache = torch.randn(backend.kv_cache_shape(num_blocks, block_size))
    perm = torch.randperm(num_blocks).tolist()
    tables = [perm[0:2], perm[2:5], perm[5:8]]
    slots = [tables[0][4 // block_size] * block_size + 4 % block_size,
             tables[1][8 // block_size] * block_size + 8 % block_size]
    slots += [tables[2][p // block_size] * block_size + p % block_size for p in range(4, 10)]
    q, k, v = (torch.randn(8, h, dim) for h in (heads, kv_heads, kv_heads))
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots), num_decode_tokens=2,
        decode_block_tables=torch.tensor([tables[0] + [0], tables[1]]), decode_context_lens=torch.tensor([5, 9]),
        prefills=[PrefillChunk(2, 6, 10, torch.tensor(tables[2]))], backend_state={"block_size": block_size})
    return backend, cache, q, k, v, meta, tables[2]


def test_references_match_torch_backend():
    backend, cache, q, k, v, meta, table = mixed_step(0)
    expected_cache = reference.reshape_and_cache(k, v, cache, meta.slot_mapping)
    backend.prepare(meta)
    out = backend.forward(q, k, v, cache, meta)
    assert torch.equal(cache, expected_cache)
    decode = reference.paged_decode(q[:2], cache, meta.decode_block_tables, meta.decode_context_lens, backend.scale)
    prefill = reference.paged_prefill(q, cache, [(2, 6, 10)], [table], backend.scale)
    torch.testing.assert_close(decode, out[:2], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(prefill[2:], out[2:], rtol=1e-5, atol=1e-5)
    assert reference.paged_decode(q[:1], cache, meta.decode_block_tables[:1], torch.tensor([0]), 1.0).abs().sum() == 0


def test_references_match_torch_backend_with_window_and_sinks():
    """The same with a sliding window of 3 and random sinks (gpt-oss's attention): the
    references the CUDA kernels' tests use for both."""
    backend, cache, q, k, v, meta, table = mixed_step(1)
    sinks, window = torch.randn(q.shape[1]), 3
    backend.prepare(meta)
    out = backend.forward(q, k, v, cache, meta, sliding_window=window, sinks=sinks)
    decode = reference.paged_decode(q[:2], cache, meta.decode_block_tables, meta.decode_context_lens, backend.scale,
                                    window, sinks)
    prefill = reference.paged_prefill(q, cache, [(2, 6, 10)], [table], backend.scale, window, sinks)
    torch.testing.assert_close(decode, out[:2], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(prefill[2:], out[2:], rtol=1e-5, atol=1e-5)
    plain = reference.paged_decode(q[:2], cache, meta.decode_block_tables, meta.decode_context_lens, backend.scale)
    assert not torch.allclose(decode, plain, atol=1e-3)  # the window and the sinks change the result
