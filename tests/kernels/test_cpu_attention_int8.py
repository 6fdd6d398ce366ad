"""The int8 KV cache (--kv-cache-dtype int8): the torch reference's quantize/dequantize
(engine/attention/kv_format.py) and fp8's convention, the C++ cache write against it bit for
bit, and the C++ int8 decode (cpu_kernels/csrc/paged_attention_int8.cpp) against the torch
reference run on the dequantized cache, over the float kernel's test grid.

The caches come from test_cpu_attention.PagedCache (shuffled tables, NaN wherever a sequence
must not read): quantized, a NaN row keeps a NaN scale, so reading one still poisons the output."""

from __future__ import annotations

import pytest
import torch

import cpu_kernels
from engine.attention import get_attention_backend
from engine.attention.kv_format import FP8_MAX, MIN_SCALE, dequantize_int8, int8_row_scales, kv_cache_format, \
    quantize_int8
from kernel_inputs import TOLERANCE, assert_close, mixed_step, relative_error
from test_cpu_attention import PagedCache, lengths_for

REASON = cpu_kernels.unavailable_reason("paged_attention_int8") or cpu_kernels.unavailable_reason("paged_attention")
needs_kernel = pytest.mark.skipif(REASON is not None, reason=f"CPU int8 attention kernel unavailable: {REASON}")


def test_int8_rows_round_trip():
    """Each row's scale is amax/127 rounded up to bf16 (so nothing clips), its values within
    half a step; a zero row stays zero; the row is D values then the scale's 2 bytes."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(50, 3, 64, generator=gen) * torch.logspace(-6, 3, 50)[:, None, None]
    x[0] = 0
    rows = quantize_int8(x)
    assert rows.dtype == torch.int8 and rows.shape == (50, 3, 66)
    scale = int8_row_scales(rows)
    amax = x.abs().amax(-1, keepdim=True)
    assert torch.equal(scale, scale.to(torch.bfloat16).float())  # a bf16 value
    assert (scale[1:] >= amax[1:] / 127).all() and (scale[1:] <= amax[1:] / 127 * (1 + 2 ** -7)).all()
    assert (scale[0] == MIN_SCALE).all() and (rows[0, :, :64] == 0).all()
    assert (rows[..., :64].abs() <= 127).all() and (rows[1:, :, :64].abs().amax(-1) >= 126).all()
    assert ((dequantize_int8(rows) - x).abs() <= scale / 2 * (1 + 1e-6)).all()
    fmt = kv_cache_format("int8", torch.bfloat16)
    assert fmt.row_width(64) == 66 and fmt.bytes_per_token_head(64) == 66
    assert kv_cache_format("auto", torch.bfloat16).bytes_per_token_head(64) == 128
    assert fmt.dequantize(rows, torch.bfloat16).dtype == torch.bfloat16


def test_fp8_convention():
    """fp8 e4m3, per-tensor scale 1: clamp to +-448, round to nearest even; reads widen."""
    fmt = kv_cache_format("fp8", torch.bfloat16)
    x = torch.tensor([0.0, 1.0, -3.3, 1000.0, -1e6, 0.0625, 300.0]).to(torch.bfloat16)
    stored = fmt.quantize_rows(x)
    assert stored.dtype == torch.float8_e4m3fn and fmt.bytes_per_token_head(64) == 64
    assert torch.equal(stored.view(torch.uint8), x.float().clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
                       .view(torch.uint8))
    back = fmt.dequantize(stored, torch.float32)
    assert back.tolist()[:4] == [0.0, 1.0, -3.25, 448.0] and back[4] == -448.0 and back[6] == 288.0
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        kv_cache_format("int4", torch.bfloat16)


def quantized(paged: PagedCache) -> torch.Tensor:
    """The float cache's int8 twin (NaN rows keep a NaN scale)."""
    return quantize_int8(paged.kv_cache.float())


def reference(q: torch.Tensor, cache: torch.Tensor, paged: PagedCache, scale: float, window: int | None = None,
              sinks: torch.Tensor | None = None) -> torch.Tensor:
    """The float32 reference on the cache dequantized to q's dtype (as the torch backend reads it)."""
    from cpu_kernels import reference as ref
    deq = kv_cache_format("int8", q.dtype).dequantize(cache, q.dtype)
    return ref.paged_decode(q, deq, paged.block_tables, paged.context_lens, scale, window, sinks)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cache_write_equals_reference_bits(dtype):
    hkv, dim, blocks, block_size = 3, 64, 6, 16
    gen = torch.Generator().manual_seed(0)
    rows = torch.randn(7, (4 + 2 * hkv) * dim, generator=gen) * torch.logspace(-4, 4, 7)[:, None]
    rows[1] = 0  # a zero row: the minimum scale
    rows[2, :dim] = torch.arange(dim) * 0.5 - 16  # halves: ties round to even
    kv = rows.to(dtype).view(7, -1, dim)  # strided rows, as split from the fused qkv
    k, v = kv[:, 4:4 + hkv], kv[:, 4 + hkv:]
    slots = torch.tensor([17, 3, 95, 40, 0, 60])  # the seventh row is padding: no slot
    cache = torch.zeros(2, hkv, blocks, block_size, dim + 2, dtype=torch.int8)
    cpu_kernels.ops.reshape_and_cache(k, v, cache, slots)
    expected = torch.zeros_like(cache)
    flat = expected.view(2, hkv, -1, dim + 2)
    flat[0].index_copy_(1, slots, quantize_int8(k[:6]).transpose(0, 1))
    flat[1].index_copy_(1, slots, quantize_int8(v[:6]).transpose(0, 1))
    assert torch.equal(cache, expected)
    with pytest.raises(RuntimeError, match="outside the cache"):
        cpu_kernels.ops.reshape_and_cache(k, v, cache, torch.tensor([blocks * block_size]))


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("dim", [64, 128])
@pytest.mark.parametrize("group", [1, 3, 4, 8])
def test_decode_matches_dequantized_reference(group, dim, block_size, dtype):
    from cpu_kernels import ops
    lens = lengths_for(block_size)
    paged = PagedCache(lens, 2, dim, block_size, torch.float32, seed=group * dim + block_size)
    cache = quantized(paged)
    q = paged.queries(len(lens), 2 * group, 2, dim).to(dtype)
    out = ops.paged_decode(q, cache, paged.block_tables, paged.context_lens, dim ** -0.5)
    assert out.dtype == dtype and out.shape == q.shape
    assert_close(out, reference(q, cache, paged, dim ** -0.5), dtype, f"int8 cache, {dtype}")


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window,sinks", [(None, False), (None, True), (5, False), (600, True)])
def test_partitions_windows_and_sinks(dtype, window, sinks):
    """Contexts split into partitions, windows starting mid-block (everything before them
    poisoned), and sinks joining each denominator."""
    from cpu_kernels import ops
    lens = [1, 17, 511, 513, 2100]
    paged = PagedCache(lens, 2, 64, 16, torch.float32, seed=7)
    if window is not None:
        for b, n in enumerate(lens):
            start = max(0, n - window)
            paged.kv_cache[:, :, paged.block_tables[b, start // 16], :start % 16] = float("nan")
            for i in range(start // 16):
                paged.kv_cache[:, :, paged.block_tables[b, i]] = float("nan")
    cache = quantized(paged)
    q = paged.queries(len(lens), 6, 2, 64).to(dtype)
    sink = torch.linspace(-3.0, 4.0, 6) if sinks else None
    out = ops.paged_decode(q, cache, paged.block_tables, paged.context_lens, 0.125, window, sink)
    assert_close(out, reference(q, cache, paged, 0.125, window, sink), dtype, f"window {window}, sinks {sinks}")


@needs_kernel
def test_batch_invariance():
    """A sequence's output has the same bits alone as in any batch."""
    from cpu_kernels import ops
    lens = [3, 700, 40, 1300]
    paged = PagedCache(lens, 2, 64, 16, torch.float32, seed=11)
    cache = quantized(paged)
    q = paged.queries(len(lens), 8, 2, 64).to(torch.bfloat16)
    batch = ops.paged_decode(q, cache, paged.block_tables, paged.context_lens, 0.125)
    for b in range(len(lens)):
        alone = ops.paged_decode(q[b:b + 1], cache, paged.block_tables[b:b + 1].contiguous(),
                                 paged.context_lens[b:b + 1].contiguous(), 0.125)
        assert torch.equal(alone[0], batch[b]), f"row {b}"


@needs_kernel
def test_bad_int8_cache_is_refused():
    from cpu_kernels import ops
    paged = PagedCache([5], 2, 64, 16, torch.float32)
    q = paged.queries(1, 4, 2, 64)
    wrong_row = quantized(paged)[..., :65].contiguous()
    with pytest.raises(ValueError, match="int8"):
        ops.paged_decode(q, wrong_row, paged.block_tables, paged.context_lens, 0.125)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window,sinks", [(None, False), (20, False), (None, True)])
def test_backend_matches_torch_backend(dtype, window, sinks):
    """A step of decodes and prefill chunks on an int8 cache: the cpu backend's C++ write and
    decode against the torch backend's quantize and dequantizing reads; the same cache bits.
    With gpt-oss's sinks too (prefill chunks take the torch backend's path with them)."""
    heads, kv_heads, dim, num_blocks, block_size, padding = 12, 4, 64, 100, 16, 3
    sink = torch.linspace(-2.0, 3.0, heads) if sinks else None
    fmt = kv_cache_format("int8", dtype)
    outs, caches = [], []
    for name in ("torch", "cpu"):
        backend = get_attention_backend(name, heads, kv_heads, dim, "cpu", dtype, fmt)
        assert backend.name == name and backend.kv_cache_shape(num_blocks, block_size)[-1] == dim + 2
        torch.manual_seed(0)
        cache = quantize_int8(torch.randn(2, kv_heads, num_blocks, block_size, dim))
        meta = mixed_step(block_size, num_blocks, torch.Generator().manual_seed(1), "cpu")
        fused = torch.randn(meta.slot_mapping.numel() + padding, heads + 2 * kv_heads, dim).to(dtype)
        q, k, v = fused.split([heads, kv_heads, kv_heads], dim=1)
        backend.prepare(meta)
        outs.append(backend.forward(q, k, v, cache, meta, sliding_window=window, sinks=sink).float())
        caches.append(cache)
    assert torch.equal(caches[0], caches[1])
    assert relative_error(outs[1], outs[0]) <= 2 * TOLERANCE[dtype]
    assert outs[1][-padding:].abs().sum() == 0
