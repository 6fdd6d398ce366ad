"""Paged prefill/extend attention against the float32 reference: chunks with and without
a cached prefix, single-token and block-straddling chunks, behind leading decode rows; over a
cache in the model's dtype and over an fp8 one."""

from __future__ import annotations

import pytest
import torch

from gpu_skip import pytestmark  # noqa: F401  (skips this module without a GPU)
from kernel_inputs import DTYPES, FP8_IDS, GQA, PagedContexts, assert_close, release_before, strided_qkv
from cupy_kernels import ops, reference

# (new tokens, context length): a fresh prompt, extends over cached prefixes, one token.
CHUNKS = [(37, 37), (16, 50), (1, 33), (70, 70), (5, 300), (33, 64)]
LEADING_ROWS = 3  # rows before the first chunk (decodes, in the engine): must stay untouched


def run_prefill(ctx: PagedContexts, num_q_heads: int, num_kv_heads: int, head_size: int, dtype: torch.dtype,
                window: int | None = None, sinks_scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(the kernel's out, the reference's) for CHUNKS behind LEADING_ROWS rows of decodes;
    `sinks_scale`: random sinks of that spread, one per query head."""
    num_tokens = LEADING_ROWS + sum(n for n, _ in CHUNKS)
    q, _, _ = strided_qkv(num_tokens, num_q_heads, num_kv_heads, head_size, dtype, ctx.gen)
    sinks = None if sinks_scale is None else torch.randn(num_q_heads, device="cuda", generator=ctx.gen) * sinks_scale
    chunks, start = [], LEADING_ROWS
    for new, context in CHUNKS:
        chunks.append((start, new, context))
        start += new
    tables = torch.nn.utils.rnn.pad_sequence([torch.tensor(t, device="cuda") for t in ctx.tables], batch_first=True)
    batch = ops.build_prefill_batch(chunks, tables, num_q_heads // num_kv_heads, torch.device("cuda"))
    out = torch.full(q.shape, float("nan"), dtype=dtype, device="cuda")
    scale = head_size ** -0.5
    ops.prefill_attention(out, q, ctx.kv_cache, batch, scale, window, sinks)
    torch.cuda.synchronize()
    return out, reference.paged_prefill(q, ctx.kv_cache, chunks, ctx.tables, scale, window, sinks)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_size", [64, 96, 128])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("heads", GQA[:4], ids=[f"{h}q{k}kv" for h, k in GQA[:4]])
def test_prefill(dtype, head_size, block_size, heads):
    check_prefill(dtype, head_size, block_size, heads)


# fp8 ids ("fp32", "fp16", "bf16", not "dtypeN"): gpu_session.sh's sanitizer filters keep their cases.
@pytest.mark.parametrize("dtype", DTYPES, ids=FP8_IDS)
@pytest.mark.parametrize("head_size", [64, 96, 128])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("heads", GQA[:4], ids=[f"{h}q{k}kv" for h, k in GQA[:4]])
def test_prefill_fp8_cache(dtype, head_size, block_size, heads):
    check_prefill(dtype, head_size, block_size, heads, torch.float8_e4m3fn)


def check_prefill(dtype, head_size, block_size, heads, kv_dtype=None):
    num_q_heads, num_kv_heads = heads
    ctx = PagedContexts([n for _, n in CHUNKS], num_kv_heads, head_size, block_size, dtype, seed=head_size,
                        kv_dtype=kv_dtype)
    out, ref = run_prefill(ctx, num_q_heads, num_kv_heads, head_size, dtype)
    assert out[:LEADING_ROWS].isnan().all(), "wrote rows outside its chunks"
    assert_close(out[LEADING_ROWS:], ref[LEADING_ROWS:], dtype, f"prefill, cache {ctx.kv_cache.dtype}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_size", [64, 128])
@pytest.mark.parametrize("window", [None, 1, 8, 40])
@pytest.mark.parametrize("kv_dtype", [None, torch.float8_e4m3fn], ids=["kv_model", "kv_fp8"])
def test_prefill_window_and_sinks(dtype, head_size, window, kv_dtype):
    """gpt-oss's attention: each query over the last `window` positions (blocks before the
    chunk's first window released: poisoned) and a sink per query head."""
    num_q_heads, num_kv_heads, block_size = 16, 2, 16
    ctx = PagedContexts([n for _, n in CHUNKS], num_kv_heads, head_size, block_size, dtype, seed=head_size,
                        kv_dtype=kv_dtype)
    if window:
        release_before(ctx, [context - new - window + 1 for new, context in CHUNKS])
    out, ref = run_prefill(ctx, num_q_heads, num_kv_heads, head_size, dtype, window, sinks_scale=2)
    assert_close(out[LEADING_ROWS:], ref[LEADING_ROWS:], dtype, f"prefill window {window}")
