"""Sliding-window attention in the torch and cpu backends against a dense reference: a
query at position i sees keys j with i - W < j <= i. Block-table entries before a row's
first visible block are -1 (as the block manager leaves released blocks), so reading one
would fail: the test also proves they are never read."""

from __future__ import annotations

import pytest
import torch

import cpu_kernels
from engine.attention import AttentionMetadata, PrefillChunk, get_attention_backend

HEADS, KV_HEADS, DIM, BLOCK, NUM_BLOCKS = 4, 2, 16, 4, 64
# (context length, new tokens): decodes first, then a fresh prompt and chunks over a cached prefix.
ROWS = [(1, 1), (7, 1), (30, 1), (45, 1), (9, 9), (40, 11), (23, 5)]
needs_kernel = pytest.mark.skipif(not cpu_kernels.available("paged_attention"),
                                  reason="CPU attention kernel unavailable")


def windowed_step(window: int, gen: torch.Generator):
    """A step's metadata, with each row's released entries (before its window) set to -1."""
    perm = torch.randperm(NUM_BLOCKS, generator=gen).tolist()
    tables, slots, prefills, row = [], [], [], 0
    for context, new in ROWS:
        count = -(-context // BLOCK)
        table, perm = perm[:count], perm[count:]
        first_visible = max(0, context - new - window + 1) // BLOCK
        table[:first_visible] = [-1] * first_visible
        tables.append(table)
        slots += [table[p // BLOCK] * BLOCK + p % BLOCK for p in range(context - new, context)]
        if new > 1:
            prefills.append(PrefillChunk(row, new, context, torch.tensor(table)))
        row += new
    decodes = [t for t, (_, new) in zip(tables, ROWS) if new == 1]
    width = max(len(t) for t in decodes)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots), num_decode_tokens=len(decodes),
        decode_block_tables=torch.tensor([t + [0] * (width - len(t)) for t in decodes]),
        decode_context_lens=torch.tensor([c for c, new in ROWS if new == 1]),
        prefills=prefills, backend_state={"block_size": BLOCK})
    return meta, tables


def dense_reference(q, cache, tables, window):
    """Each query row against its visible keys, gathered position by position."""
    out, row, group = torch.zeros_like(q), 0, HEADS // KV_HEADS
    for (context, new), table in zip(ROWS, tables):
        for i in range(context - new, context):
            keys = range(max(0, i - window + 1) if window else 0, i + 1)
            blocks = torch.tensor([table[j // BLOCK] for j in keys])
            offsets = torch.tensor([j % BLOCK for j in keys])
            for h in range(HEADS):
                k, v = cache[0, h // group][blocks, offsets], cache[1, h // group][blocks, offsets]
                probs = torch.softmax(k @ q[row, h] * DIM ** -0.5, dim=0)
                out[row, h] = probs @ v
            row += 1
    return out


def run_backend(name: str, window: int | None, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    backend = get_attention_backend(name, HEADS, KV_HEADS, DIM, "cpu")
    cache = torch.randn(backend.kv_cache_shape(NUM_BLOCKS, BLOCK), generator=gen)
    meta, tables = windowed_step(window or 10**6, gen)
    num_tokens = meta.slot_mapping.numel()
    q, k, v = (torch.randn(num_tokens + 2, h, DIM, generator=gen) for h in (HEADS, KV_HEADS, KV_HEADS))
    backend.prepare(meta)
    out = backend.forward(q, k, v, cache, meta, sliding_window=window)
    return out, q, cache, tables, num_tokens


@pytest.mark.parametrize("window", [1, 5, 8, 13])
def test_torch_backend_matches_dense_reference(window):
    out, q, cache, tables, n = run_backend("torch", window)
    expected = dense_reference(q, cache, tables, window)
    torch.testing.assert_close(out[:n], expected[:n], rtol=1e-5, atol=1e-5)
    assert out[n:].abs().sum() == 0  # padding rows


def test_window_changes_the_result():
    windowed = run_backend("torch", 8)[0]
    full, q, cache, tables, n = run_backend("torch", 10**6)  # wider than any context
    torch.testing.assert_close(full[:n], dense_reference(q, cache, tables, None)[:n], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(windowed[:n], full[:n], atol=1e-3)


@needs_kernel
@pytest.mark.parametrize("window", [1, 5, 8, 13])
def test_cpu_backend_matches_torch_backend(window):
    ours = run_backend("cpu", window)[0]
    torch_out, _, _, _, n = run_backend("torch", window)
    torch.testing.assert_close(ours[:n], torch_out[:n], rtol=1e-5, atol=1e-5)
