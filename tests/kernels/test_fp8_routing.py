"""--kv-cache-dtype fp8 on the cupy backend, host side (CPU, no GPU): which kernel each cache
and model dtype reach, that every name the launchers can ask for is among the instantiations
compiled (tests/kernels/test_compile.py compiles those with NVRTC), and the refusals: an
int8 cache, a cache of another dtype."""

from __future__ import annotations

import pytest
import torch

from cupy_kernels import compile as kc
from cupy_kernels import ops
from engine.attention.cupy_backend import check_kv_format
from engine.attention.kv_format import KvCacheFormat

FP8 = torch.float8_e4m3fn


def cache(dtype: torch.dtype) -> torch.Tensor:
    return torch.empty((2, 1, 1, 16, 64), dtype=dtype, device="meta")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_an_fp8_cache_routes_to_the_fp8_kernels(dtype):
    assert ops.kv_dtype_name(cache(dtype), dtype) is None
    assert ops.kv_dtype_name(cache(FP8), dtype) == kc.FP8
    assert kc.cache_expr(ops.DTYPE_NAMES[dtype], kc.FP8).startswith("reshape_and_cache_fp8<")


@pytest.mark.parametrize("cache_dtype, dtype", [(torch.float16, torch.bfloat16), (torch.int8, torch.bfloat16),
                                                (torch.bfloat16, torch.float32), (torch.uint8, torch.float16)])
def test_other_pairs_are_refused(cache_dtype, dtype):
    with pytest.raises(ValueError, match="KV cache"):
        ops.kv_dtype_name(cache(cache_dtype), dtype)


def launchable() -> list[tuple[str, str]]:
    """Every (source, name) the decode, prefill and cache launchers can produce, by walking
    the plans the decode heuristic can return and every dtype and cache pair it can meet."""
    names = []
    for dtype in ops.DTYPE_NAMES.values():
        kvs = [None, kc.FP8] if dtype in kc.FP8_MODEL_DTYPES else [None]
        for d in kc.HEAD_SIZES:
            for bs in kc.BLOCK_SIZES:
                for kv in kvs:
                    names.append(("prefill", kc.prefill_expr(dtype, d, bs, kv)))
                    names.append(("cache", kc.cache_expr(dtype, kv)))
                    for group in (1, 3, 8, 12, 20):
                        for bound in (64, 8192):
                            for tc in [False, True] if dtype in kc.MMA_DTYPES else [False]:
                                plan = ops.plan_decode(1, 8, group, bound, 132, tc)
                                names.append(ops.decode_kernel(plan, dtype, d, bs, kv))
    return names


def test_every_launchable_kernel_is_compiled():
    compiled = kc.all_instantiations()
    names = launchable()
    missing = [(source, expr) for source, expr in names if expr not in compiled[source]]
    assert not missing, missing[:5]
    fp8 = {expr for _, expr in names if "fp8" in expr}
    # tensor cores, split-K, prefill and the cache write all have fp8 variants
    assert any(e.startswith("paged_decode_mma<") and "true" in e for e in fp8)
    assert any(e.startswith("paged_decode<") and "true" in e for e in fp8)
    assert any(e.startswith("paged_prefill<") for e in fp8) and any(e.startswith("reshape_and_cache_fp8") for e in fp8)


def test_fp8_names_extend_the_16_bit_ones():
    """An fp8 kernel is its model dtype's kernel with one more template argument: the names the
    docs and bench use for the 16-bit caches stay as they were."""
    assert kc.decode_expr("bfloat16", 128, 16, 8, False) == "paged_decode<bf16_t, 128, 16, 8, false>"
    fp8 = kc.decode_expr("bfloat16", 128, 16, 8, False, kc.FP8)
    assert fp8 == "paged_decode<bf16_t, 128, 16, 8, false, fp8_e4m3_t>"
    assert kc.prefill_expr("float16", 96, 32, kc.FP8) == "paged_prefill<half_t, 96, 32, fp8_e4m3_t>"


def test_the_backend_refuses_the_format_without_kernels():
    check_kv_format(None)
    check_kv_format(KvCacheFormat("auto", torch.float32))
    check_kv_format(KvCacheFormat("fp8", torch.bfloat16))
    check_kv_format(KvCacheFormat("fp8", torch.float16))
    check_kv_format(KvCacheFormat("fp8", torch.float32))
    for dtype in (torch.float32, torch.bfloat16):
        with pytest.raises(ValueError, match="'int8' has no CUDA kernels.*'fp8'.*'torch'"):
            check_kv_format(KvCacheFormat("int8", dtype))
