"""Paged decode attention (single pass and split-K) against the float32 reference: the CUDA-core
kernel (decode.cu) and, for fp16/bf16, the tensor-core one (decode_mma.cu); each over a cache
in the model's dtype and over an fp8 one, which the reference reads through torch's own e4m3
conversion."""

from __future__ import annotations

import math

import pytest
import torch

from gpu_skip import pytestmark  # noqa: F401  (skips this module without a GPU)
from kernel_inputs import DTYPES, FP8_IDS, GQA, PagedContexts, assert_close, release_before, strided_qkv
from cupy_kernels import ops, reference


def contexts(block_size: int) -> list[int]:
    """Empty, one token, around block edges, across split-K partition edges, and long."""
    return [0, 1, block_size - 1, block_size, block_size + 1, 77, 128, 131, ops.PARTITION_TOKENS,
            ops.PARTITION_TOKENS + 3, 1333]


def run_decode(ctx: PagedContexts, q: torch.Tensor, plan: ops.DecodePlan, scale: float, window: int | None = None,
               sinks: torch.Tensor | None = None) -> torch.Tensor:
    out = torch.full(q.shape, float("nan"), dtype=q.dtype, device="cuda")
    workspace = torch.full((ops.decode_workspace_numel(*q.shape[:2], q.shape[2], plan) or 1,), float("nan"),
                           device="cuda")
    ops.decode_attention(out, q, ctx.kv_cache, ctx.block_tables, ctx.context_lens, scale, plan, workspace,
                         window, sinks)
    torch.cuda.synchronize()
    return out


# GQA 20:1 takes two tensor-core CTAs per KV head (16 heads each, the second one 4).
MMA_GQA = GQA + ((20, 1),)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_size", [64, 96, 128])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("heads", MMA_GQA, ids=[f"{h}q{k}kv" for h, k in MMA_GQA])
@pytest.mark.parametrize("split", [0, ops.PARTITION_TOKENS, 128], ids=["single", "split", "split128"])
@pytest.mark.parametrize("tensor_cores", [False, True], ids=["simt", "mma"])
def test_decode(dtype, head_size, block_size, heads, split, tensor_cores):
    check_decode(dtype, head_size, block_size, heads, split, tensor_cores)


# fp8 ids ("fp32", "fp16", "bf16", not "dtypeN"): gpu_session.sh's sanitizer filters keep their cases.
@pytest.mark.parametrize("dtype", DTYPES, ids=FP8_IDS)
@pytest.mark.parametrize("head_size", [64, 96, 128])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("heads", MMA_GQA, ids=[f"{h}q{k}kv" for h, k in MMA_GQA])
@pytest.mark.parametrize("split", [0, ops.PARTITION_TOKENS, 128], ids=["single", "split", "split128"])
@pytest.mark.parametrize("tensor_cores", [False, True], ids=["simt", "mma"])
def test_decode_fp8_cache(dtype, head_size, block_size, heads, split, tensor_cores):
    check_decode(dtype, head_size, block_size, heads, split, tensor_cores, torch.float8_e4m3fn)


def check_decode(dtype, head_size, block_size, heads, split, tensor_cores, kv_dtype=None):
    if tensor_cores and dtype == torch.float32:
        pytest.skip("the tensor-core decode takes fp16/bf16 only")
    if heads == (20, 1) and not tensor_cores:
        pytest.skip("group 20 is for the tensor-core CTAs of 16 heads")
    num_q_heads, num_kv_heads = heads
    lens = contexts(block_size)
    ctx = PagedContexts(lens, num_kv_heads, head_size, block_size, dtype, seed=len(lens) + head_size,
                        kv_dtype=kv_dtype)
    q, _, _ = strided_qkv(len(lens), num_q_heads, num_kv_heads, head_size, dtype, ctx.gen)
    plan = ops.plan_decode(len(lens), num_kv_heads, num_q_heads // num_kv_heads, 0, 132, tensor_cores)
    if split:
        plan = ops.DecodePlan(plan.heads_per_cta, plan.num_chunks, math.ceil(max(lens) / split) + 1, split,
                              tensor_cores)
    scale = head_size ** -0.5
    out = run_decode(ctx, q, plan, scale)
    ref = reference.paged_decode(q, ctx.kv_cache, ctx.block_tables, ctx.context_lens, scale)
    assert_close(out, ref, dtype, f"decode {plan} cache {ctx.kv_cache.dtype}")
    assert out[0].abs().sum() == 0, "an empty context must give zeros"


@pytest.mark.parametrize("dtype", [torch.bfloat16])
@pytest.mark.parametrize("tensor_cores", [False, True], ids=["simt", "mma"])
@pytest.mark.parametrize("kv_dtype", [None, torch.float8_e4m3fn], ids=["kv_model", "kv_fp8"])
def test_decode_large_batch(dtype, tensor_cores, kv_dtype):
    """A batch as the engine runs it: 64 random contexts, GQA 8:1, the heuristic's plan."""
    gen = torch.Generator().manual_seed(1)
    lens = torch.randint(1, 3000, (64,), generator=gen).tolist()
    ctx = PagedContexts(lens, 4, 128, 16, dtype, seed=2, kv_dtype=kv_dtype)
    q, _, _ = strided_qkv(64, 32, 4, 128, dtype, ctx.gen)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    plan = ops.plan_decode(64, 4, 8, ctx.block_tables.shape[1] * 16, sms, tensor_cores)
    out = run_decode(ctx, q, plan, 128 ** -0.5)
    ref = reference.paged_decode(q, ctx.kv_cache, ctx.block_tables, ctx.context_lens, 128 ** -0.5)
    assert_close(out, ref, dtype, f"decode {plan}")


@pytest.mark.parametrize("kv_dtype", [None, torch.float8_e4m3fn], ids=["kv_model", "kv_fp8"])
def test_decode_is_deterministic(kv_dtype):
    lens = [1000, 5, 2000]
    ctx = PagedContexts(lens, 2, 128, 16, torch.bfloat16, seed=3, kv_dtype=kv_dtype)
    q, _, _ = strided_qkv(3, 16, 2, 128, torch.bfloat16, ctx.gen)
    for plan in (ops.DecodePlan(8, 1, 1), ops.DecodePlan(8, 1, 4), ops.DecodePlan(8, 1, 16, 128),
                 ops.DecodePlan(16, 1, 1, tensor_cores=True), ops.DecodePlan(16, 1, 16, 128, True)):
        first = run_decode(ctx, q, plan, 0.1)
        assert all(torch.equal(first, run_decode(ctx, q, plan, 0.1)) for _ in range(3)), f"{plan}: a race?"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_size", [64, 128])
@pytest.mark.parametrize("split", [0, 128], ids=["single", "split128"])
@pytest.mark.parametrize("tensor_cores", [False, True], ids=["simt", "mma"])
@pytest.mark.parametrize("window", [None, 1, 128, 300])
def test_decode_window_and_sinks(dtype, head_size, split, tensor_cores, window):
    """gpt-oss's attention: a sliding window (blocks before it released: poisoned) and a sink
    per query head; partitions wholly before the window are skipped."""
    check_window_and_sinks(dtype, head_size, split, tensor_cores, window)


@pytest.mark.parametrize("dtype", DTYPES, ids=FP8_IDS)
@pytest.mark.parametrize("head_size", [64, 128])
@pytest.mark.parametrize("split", [0, 128], ids=["single", "split128"])
@pytest.mark.parametrize("tensor_cores", [False, True], ids=["simt", "mma"])
@pytest.mark.parametrize("window", [None, 1, 128, 300])
def test_decode_window_and_sinks_fp8_cache(dtype, head_size, split, tensor_cores, window):
    check_window_and_sinks(dtype, head_size, split, tensor_cores, window, torch.float8_e4m3fn)


def check_window_and_sinks(dtype, head_size, split, tensor_cores, window, kv_dtype=None):
    if tensor_cores and dtype == torch.float32:
        pytest.skip("the tensor-core decode takes fp16/bf16 only")
    num_q_heads, num_kv_heads, block_size = 16, 2, 16
    lens = contexts(block_size)
    ctx = PagedContexts(lens, num_kv_heads, head_size, block_size, dtype, seed=head_size + (window or 0),
                        kv_dtype=kv_dtype)
    if window:
        release_before(ctx, [n - window for n in lens])
    q, _, _ = strided_qkv(len(lens), num_q_heads, num_kv_heads, head_size, dtype, ctx.gen)
    sinks = torch.randn(num_q_heads, device="cuda", generator=ctx.gen) * 2
    plan = ops.plan_decode(len(lens), num_kv_heads, num_q_heads // num_kv_heads, 0, 132, tensor_cores)
    if split:
        plan = ops.DecodePlan(plan.heads_per_cta, plan.num_chunks, math.ceil(max(lens) / split) + 1, split,
                              tensor_cores)
    scale = head_size ** -0.5
    out = run_decode(ctx, q, plan, scale, window, sinks)
    ref = reference.paged_decode(q, ctx.kv_cache, ctx.block_tables, ctx.context_lens, scale, window, sinks)
    assert_close(out, ref, dtype, f"decode {plan} window {window}")
