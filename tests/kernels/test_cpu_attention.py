"""The C++ CPU decode kernel (cpu_kernels/csrc/paged_attention.cpp) against the float32
reference, the `cpu` attention backend against the `torch` one, batch invariance, the
cache write against the torch backend's, and the fallback to torch where the kernels
cannot build.

Inputs are built to expose indexing bugs: shuffled block tables, NaN in every cache slot a
sequence must not read (the tail of its last block, and a poison block padding its table)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import cpu_kernels
from kernel_inputs import TOLERANCE, assert_close, mixed_step, relative_error
from engine.attention import get_attention_backend

REASON = cpu_kernels.unavailable_reason("paged_attention")  # builds the kernel on first run
needs_kernel = pytest.mark.skipif(REASON is not None, reason=f"CPU attention kernel unavailable: {REASON}")
ROOT = Path(__file__).resolve().parents[2]


class PagedCache:
    """`context_lens` sequences in shuffled blocks of one cache; NaN wherever none may read."""

    def __init__(self, context_lens: list[int], num_kv_heads: int, dim: int, block_size: int,
                 dtype: torch.dtype, seed: int = 0) -> None:
        self.gen = torch.Generator().manual_seed(seed)
        needed = [-(-n // block_size) for n in context_lens]
        num_blocks = sum(needed) + 4
        poison = num_blocks - 1
        self.kv_cache = torch.randn((2, num_kv_heads, num_blocks, block_size, dim), generator=self.gen).to(dtype)
        self.kv_cache[:, :, poison] = float("nan")
        perm = torch.randperm(num_blocks - 1, generator=self.gen).tolist()
        width = max(needed) + 2  # rows padded past their last block, as the runner pads
        rows = []
        for n, count in zip(context_lens, needed):
            table, perm = perm[:count], perm[count:]
            if n % block_size:  # the unused tail of the last block
                self.kv_cache[:, :, table[-1], n % block_size:] = float("nan")
            rows.append(table + [poison] * (width - count))
        self.block_tables = torch.tensor(rows, dtype=torch.long)
        self.context_lens = torch.tensor(context_lens, dtype=torch.long)

    def queries(self, batch: int, num_heads: int, num_kv_heads: int, dim: int) -> torch.Tensor:
        """q as the model makes it: a strided view into a fused [B, Hq + 2 Hkv, D] tensor."""
        fused = torch.randn((batch, num_heads + 2 * num_kv_heads, dim), generator=self.gen)
        return fused.to(self.kv_cache.dtype)[:, :num_heads]


def lengths_for(block_size: int) -> list[int]:
    return [1, block_size - 1, block_size, block_size + 1, 300, 1000]


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("dim", [64, 128])
@pytest.mark.parametrize("group", [1, 3, 4, 8])
def test_decode_matches_reference(group, dim, block_size, dtype):
    from cpu_kernels import ops, reference
    num_kv_heads = 2
    num_heads = group * num_kv_heads
    lens = lengths_for(block_size)
    paged = PagedCache(lens, num_kv_heads, dim, block_size, dtype, seed=group * dim + block_size)
    q = paged.queries(len(lens), num_heads, num_kv_heads, dim)
    scale = dim ** -0.5
    out = ops.paged_decode(q, paged.kv_cache, paged.block_tables, paged.context_lens, scale)
    assert out.dtype == dtype and out.shape == q.shape
    ref = reference.paged_decode(q, paged.kv_cache, paged.block_tables, paged.context_lens, scale)
    for b, n in enumerate(lens):
        assert_close(out[b], ref[b], dtype, f"context {n}")


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_long_contexts_split_into_partitions(dtype):
    """Past 512 tokens a context is split and the partitions combined."""
    from cpu_kernels import ops, reference
    lens = [511, 512, 513, 2100]
    paged = PagedCache(lens, 2, 64, 16, dtype, seed=3)
    q = paged.queries(len(lens), 6, 2, 64)
    out = ops.paged_decode(q, paged.kv_cache, paged.block_tables, paged.context_lens, 0.125)
    ref = reference.paged_decode(q, paged.kv_cache, paged.block_tables, paged.context_lens, 0.125)
    assert_close(out, ref, dtype, "long contexts")


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [1, 5, 16, 600])
def test_sliding_window_reads_only_the_window(dtype, window):
    """Each row's key loop starts at len - window, mid-block too: every earlier position is
    NaN, and the table entries before the window's block point at the poison block (as the
    block manager's released entries point nowhere)."""
    from cpu_kernels import ops, reference
    lens = [1, 7, 16, 17, 300, 1500]
    paged = PagedCache(lens, 2, 64, 16, dtype, seed=window)
    poison = paged.kv_cache.shape[2] - 1
    for b, n in enumerate(lens):
        start, table = max(0, n - window), paged.block_tables[b]
        for i in range(start // 16):
            paged.kv_cache[:, :, table[i]] = float("nan")
            table[i] = poison
        paged.kv_cache[:, :, table[start // 16], :start % 16] = float("nan")
    q = paged.queries(len(lens), 6, 2, 64)
    out = ops.paged_decode(q, paged.kv_cache, paged.block_tables, paged.context_lens, 0.125, window)
    ref = reference.paged_decode(q, paged.kv_cache, paged.block_tables, paged.context_lens, 0.125, window)
    assert_close(out, ref, dtype, f"window {window}")
    with pytest.raises(ValueError, match="window"):
        ops.paged_decode(q, paged.kv_cache, paged.block_tables, paged.context_lens, 0.125, 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [1, 8])
@pytest.mark.parametrize("num_queries,num_keys,window", [(200, 200, None), (37, 300, None), (150, 150, 16),
                                                         (64, 700, 128)])
def test_prefill_sinks_on_sdpa_equal_them_written_out(dtype, group, num_queries, num_keys, window):
    """Prefill with sinks on CPU: SDPA's flash kernel, each row scaled by sigmoid(lse - sink),
    against the scores written out with the sink as one more logit: whole prompts (causal),
    chunks after a context, windows; sinks that take most of the mass and none of it."""
    from engine.attention.torch_backend import TorchAttentionBackend
    gen = torch.Generator().manual_seed(group + num_keys)
    backend = TorchAttentionBackend(2 * group, 2, 64)
    q = torch.randn(num_queries, 2 * group, 64, generator=gen).to(dtype)
    k, v = (torch.randn(2, num_keys, 64, generator=gen).to(dtype) for _ in range(2))
    mask = None
    if window is not None:
        distance = torch.arange(num_keys - num_queries, num_keys)[:, None] - torch.arange(num_keys)[None]
        mask = (distance >= 0) & (distance < window)
    sinks = torch.linspace(-30.0, 6.0, 2 * group)
    out = backend._prefill_with_sinks(q, k, v, mask, sinks)
    assert_close(out, backend._prefill_with_sinks_written_out(q, k, v, mask, sinks), dtype, f"window {window}")
    none = torch.full((2 * group,), float("-inf"))
    assert_close(backend._prefill_with_sinks(q, k, v, mask, none),
                 backend._prefill_with_sinks_written_out(q, k, v, mask, none), dtype, "no sink")


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 5, 600])
@pytest.mark.parametrize("group", [1, 4])
def test_sinks_join_each_denominator(dtype, window, group):
    """gpt-oss's sinks: a logit per head in every softmax's denominator, in whole contexts and
    in partitions combined (past 512 tokens), with and without a window; large sinks (which
    take most of the mass) and very negative ones (none). Without sinks: the old bits."""
    from cpu_kernels import ops, reference
    lens = [1, 9, 16, 300, 513, 1500]
    paged = PagedCache(lens, 2, 64, 16, dtype, seed=group)
    q = paged.queries(len(lens), 2 * group, 2, 64)
    args = (paged.kv_cache, paged.block_tables, paged.context_lens, 0.125, window)
    sinks = torch.linspace(-30.0, 6.0, 2 * group)
    out = ops.paged_decode(q, *args, sinks=sinks)
    assert_close(out, reference.paged_decode(q, *args, sinks=sinks), dtype, f"window {window}")
    plain = ops.paged_decode(q, *args)
    assert not torch.equal(out, plain)
    assert torch.equal(ops.paged_decode(q, *args, sinks=torch.full((2 * group,), float("-inf"))), plain)
    with pytest.raises(RuntimeError, match="sinks"):
        ops.paged_decode(q, *args, sinks=sinks[:1])


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,dim,block_size,window", [(9, 3, 64, 16, None), (32, 4, 128, 32, None),
                                                                  (10, 2, 80, 16, 100), (5, 1, 64, 8, None)])
def test_batch_invariance(dtype, heads, kv_heads, dim, block_size, window):
    """A sequence's output is bitwise the same alone, in any batch, at any thread count: for
    groups that fill the bf16 kernel's head tiles and leave remainders (8, 5), head sizes with
    a tail past the last 32 columns (80), windows."""
    from cpu_kernels import ops
    lens = [1, 17, 300, 512, 700, 2000, 33]
    paged = PagedCache(lens, kv_heads, dim, block_size, dtype, seed=5)
    q = paged.queries(len(lens), heads, kv_heads, dim)
    tables, ctx, scale = paged.block_tables, paged.context_lens, dim ** -0.5
    full = ops.paged_decode(q, paged.kv_cache, tables, ctx, scale, window)
    for b in range(len(lens)):
        alone = ops.paged_decode(q[b:b + 1], paged.kv_cache, tables[b:b + 1], ctx[b:b + 1], scale, window)
        assert torch.equal(alone[0], full[b]), f"sequence {b} (context {lens[b]}) alone differs"
    order = torch.tensor([4, 0, 6, 2])
    mixed = ops.paged_decode(q[order], paged.kv_cache, tables[order], ctx[order], scale, window)
    assert torch.equal(mixed, full[order])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        serial = ops.paged_decode(q, paged.kv_cache, tables, ctx, scale, window)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(serial, full)


def attention_float64(q: torch.Tensor, paged: PagedCache, scale: float, window: int | None,
                      sinks: torch.Tensor | None) -> torch.Tensor:
    """Decode attention in float64 on the kernel's own (bf16) inputs, position by position."""
    kv_heads, block_size = paged.kv_cache.shape[1], paged.kv_cache.shape[3]
    group = q.shape[1] // kv_heads
    out = torch.zeros(q.shape, dtype=torch.float64)
    for b, length in enumerate(paged.context_lens.tolist()):
        positions = torch.arange(max(0, length - window) if window else 0, length)
        blocks, offsets = paged.block_tables[b][positions // block_size], positions % block_size
        for h in range(q.shape[1]):
            keys, values = (paged.kv_cache[i, h // group][blocks, offsets].double() for i in (0, 1))
            scores = keys @ q[b, h].double() * scale
            if sinks is not None:
                scores = torch.cat([scores, sinks[h].double().reshape(1)])
            out[b, h] = torch.softmax(scores, dim=0)[:len(positions)] @ values
    return out


@needs_kernel
@pytest.mark.parametrize("heads,kv_heads,dim,block_size", [(9, 3, 64, 16), (32, 4, 128, 16), (10, 2, 80, 32),
                                                           (7, 7, 72, 8), (6, 1, 96, 128), (4, 2, 16, 16)])
@pytest.mark.parametrize("window,sinks", [(None, False), (40, True)])
def test_bf16_error_against_float64(heads, kv_heads, dim, block_size, window, sinks):
    """bfloat16 decode against float64 attention on the same inputs, measured against the error
    that rounding the float64 result to bf16 alone makes (3e-4 to 2e-3 relative here): both
    paths add nothing visible to it (measured: 1.00x). The AVX2 path computes in fp32; on
    AVX512-BF16 the products are exact bf16 ones summed in fp32, the probabilities in two bf16
    parts. Rounding them to bf16 instead would show: 1.07x to 1.35x (measured), over the 1.05x bound."""
    from cpu_kernels import ops
    lens = [1, block_size + 1, 300, 513, 1500]
    paged = PagedCache(lens, kv_heads, dim, block_size, torch.bfloat16, seed=heads + dim)
    q = paged.queries(len(lens), heads, kv_heads, dim)
    sink = torch.linspace(-4.0, 4.0, heads) if sinks else None
    out = ops.paged_decode(q, paged.kv_cache, paged.block_tables, paged.context_lens, dim ** -0.5, window, sink)
    ref = attention_float64(q, paged, dim ** -0.5, window, sink)
    error, rounding = (((x.double() - ref).norm() / ref.norm()).item() for x in (out, ref.bfloat16()))
    assert error <= 1.05 * rounding, f"relative error {error:.2e} against float64; rounding alone {rounding:.2e}"


@needs_kernel
def test_bf16_dot_product_where_the_cpu_has_it():
    """The VDPBF16PS path is built exactly where the CPU has AVX512-BF16 (-march=native)."""
    from cpu_kernels import ops
    flags = set(Path("/proc/cpuinfo").read_text().split("flags", 1)[-1].split("\n", 1)[0].split())
    assert ops.paged_decode_bf16_dot() == ({"avx512_bf16", "avx512bw", "avx512vl"} <= flags)


@needs_kernel
def test_bad_inputs_raise_clear_errors():
    from cpu_kernels import ops
    paged = PagedCache([20, 5], 2, 64, 16, torch.float32)
    q = paged.queries(2, 4, 2, 64)
    args = (paged.kv_cache, paged.block_tables, paged.context_lens, 0.125)
    with pytest.raises(ValueError, match="q:"):
        ops.paged_decode(q.half(), *args)
    with pytest.raises(ValueError, match="kv_cache:"):
        ops.paged_decode(q, paged.kv_cache.bfloat16(), *args[1:])
    with pytest.raises(ValueError, match="block_tables:"):
        ops.paged_decode(q, paged.kv_cache, paged.block_tables.int(), *args[2:])
    with pytest.raises(ValueError, match="context_lens:"):
        ops.paged_decode(q, paged.kv_cache, paged.block_tables, paged.context_lens[:1], 0.125)
    with pytest.raises(RuntimeError, match="out of range"):  # checked in C++: it would read past the cache
        ops.paged_decode(q, paged.kv_cache, paged.block_tables + 1000, paged.context_lens, 0.125)
    with pytest.raises(RuntimeError, match="context_lens"):
        ops.paged_decode(q, paged.kv_cache, paged.block_tables, paged.context_lens * 100, 0.125)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size,sinks", [(16, False), (32, False), (16, True)])
def test_backend_matches_torch_backend(dtype, block_size, sinks):
    """Decodes and prefill chunks of one step (with gpt-oss's sinks too: the torch backend's
    decode adds a score column, the kernel a term; both prefill paths write attention out)."""
    heads, kv_heads, dim, num_blocks, padding = 12, 4, 64, 100, 3
    sink = torch.linspace(-2.0, 3.0, heads) if sinks else None
    outs, caches = [], []
    for name in ("torch", "cpu"):
        backend = get_attention_backend(name, heads, kv_heads, dim, "cpu")
        assert backend.name == name
        torch.manual_seed(0)
        cache = torch.randn(backend.kv_cache_shape(num_blocks, block_size)).to(dtype)
        meta = mixed_step(block_size, num_blocks, torch.Generator().manual_seed(1), "cpu")
        num_tokens = meta.slot_mapping.numel() + padding  # the runner pads rows on CPU
        fused = torch.randn(num_tokens, heads + 2 * kv_heads, dim).to(dtype)
        q, k, v = fused.split([heads, kv_heads, kv_heads], dim=1)
        backend.prepare(meta)
        outs.append(backend.forward(q, k, v, cache, meta, sinks=sink).float())
        caches.append(cache)
    assert torch.equal(caches[0], caches[1])
    assert relative_error(outs[1], outs[0]) <= 2 * TOLERANCE[dtype]  # both round to dtype
    assert outs[1][-padding:].abs().sum() == 0


def test_auto_picks_cpu_on_cpu_only():
    backend = get_attention_backend("auto", 8, 2, 64, "cpu")
    assert backend.name == ("cpu" if REASON is None else "torch")
    assert get_attention_backend("auto", 8, 2, 60, "cpu").name == "torch"  # head size the kernel lacks
    with pytest.raises(ValueError, match="'cpu' runs CPU kernels"):
        get_attention_backend("cpu", 8, 2, 64, "cuda")


FALLBACK_SCRIPT = """
import logging
logging.basicConfig(level=logging.WARNING, format="LOG %(levelname)s %(name)s %(message)s")
from engine.attention import get_attention_backend
print("auto ->", get_attention_backend("auto", 8, 2, 64, "cpu").name)
try:
    get_attention_backend("cpu", 8, 2, 64, "cpu")
except ValueError as e:
    print("cpu ->", e)
"""


def run_fallback(env: dict[str, str]) -> tuple[str, list[str]]:
    result = subprocess.run([sys.executable, "-c", FALLBACK_SCRIPT], cwd=ROOT, capture_output=True, text=True,
                            env={**os.environ, **env}, timeout=300)
    assert result.returncode == 0, result.stderr
    warnings = [line for line in result.stderr.splitlines() if line.startswith("LOG WARNING")]
    return result.stdout, warnings


def test_turned_off_falls_back_to_torch():
    stdout, warnings = run_fallback({"PAGEDSERVE_CPU_KERNELS": "0"})
    assert "auto -> torch" in stdout
    assert "cpu -> attention_backend 'cpu' needs the C++ attention kernel" in stdout
    assert "PAGEDSERVE_CPU_KERNELS=0" in stdout
    assert len(warnings) == 1 and "PAGEDSERVE_CPU_KERNELS=0" in warnings[0]


def test_broken_compiler_falls_back_to_torch(tmp_path):
    # A fresh cache: no build to reuse. cpp_extension runs $CXX, which fails here.
    stdout, warnings = run_fallback({"CXX": "/bin/false", "PAGEDSERVE_CACHE_DIR": str(tmp_path)})
    assert "auto -> torch" in stdout
    assert "cpu -> attention_backend 'cpu' needs the C++ attention kernel" in stdout
    assert len(warnings) == 1 and "paged_attention" in warnings[0]


def test_a_warm_cache_needs_no_compiler():
    """An image whose cache was warmed at build time loads the library without running $CXX."""
    if not cpu_kernels.available("paged_attention"):
        pytest.skip("the kernel cannot build here, so there is no warm cache")
    stdout, warnings = run_fallback({"CXX": "/bin/false"})
    assert "auto -> cpu" in stdout and not warnings


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reshape_and_cache_equals_index_copy(dtype):
    hkv, dim, blocks, block_size = 3, 64, 6, 16
    rows = torch.randn(5, (4 + 2 * hkv) * dim, generator=torch.Generator().manual_seed(0)).to(dtype)
    kv = rows.view(5, -1, dim)  # strided rows, as split from the fused qkv
    k, v = kv[:, 4:4 + hkv], kv[:, 4 + hkv:]
    slots = torch.tensor([17, 3, 95, 40])  # the fifth row is padding: no slot
    cache = torch.zeros(2, hkv, blocks, block_size, dim, dtype=dtype)
    cpu_kernels.ops.reshape_and_cache(k, v, cache, slots)
    expected = torch.zeros_like(cache)
    flat = expected.view(2, hkv, -1, dim)
    flat[0].index_copy_(1, slots, k[:4].transpose(0, 1))
    flat[1].index_copy_(1, slots, v[:4].transpose(0, 1))
    assert torch.equal(cache, expected)
    with pytest.raises(RuntimeError, match="outside the cache"):
        cpu_kernels.ops.reshape_and_cache(k, v, cache, torch.tensor([blocks * block_size]))
