"""Launchers: torch CUDA tensors in, raw pointers to the kernels, on torch's stream.

Pointers go as `data_ptr()` integers (numpy scalars fix each argument's C type), which
costs less per launch than wrapping tensors through `__cuda_array_interface__` or
DLPack (bench/kernels.py measures the three). Launches go on torch's current stream,
so that a torch CUDA-graph capture records them like any torch kernel.

Tensor layouts (all row-major):

    kv_cache      [2, Hkv, num_blocks, block_size, D]   0 = K, 1 = V; q's dtype, or
                                 float8_e4m3fn (--kv-cache-dtype fp8: written rounded to
                                 e4m3, read widened to q's dtype)
    q / out       [T, Hq, D]     token rows may be strided (q is a view of a fused qkv);
                                 heads D apart, elements contiguous
    block_tables  [B, W] int32   physical block ids, padded; context_lens masks the tail
    slot_mapping  [T] int32      block * block_size + offset; -1 = padding row
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from cupy_kernels import compile as kc

LOG2E = 1.4426950408889634
THREADS = 128  # every kernel runs 128-thread CTAs
PARTITION_TOKENS = 512  # split-K partition length when a plan names none
# Partition lengths plan_decode picks from, longest first: fewer partitions write fewer
# partials, more of them fill the chip (measured on an H200: bench/results/gqa-sweep-*).
PARTITION_CHOICES = (1024, 512, 256, 128)
PREFILL_ROWS = 16  # query rows per prefill CTA (QROWS in prefill.cu)
MAX_HEADS_PER_CTA = 8  # largest GROUP_TILES entry
MMA_HEADS_PER_CTA = 16  # the tensor-core decode's CTA: the M rows of mma.sync (MMA_ROWS in decode_mma.cu)
DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}
FP8 = torch.float8_e4m3fn


def kv_dtype_name(kv_cache: torch.Tensor, dtype: torch.dtype) -> str | None:
    """The kernels' cache type for a cache read or written with `dtype` values: None for a
    cache in that dtype, kc.FP8 for an fp8 one; anything else is an error (the byte-moving
    cache write would scramble it silently)."""
    if kv_cache.dtype == dtype:
        return None
    name = DTYPE_NAMES.get(dtype)
    if kv_cache.dtype == FP8 and name in kc.FP8_MODEL_DTYPES:
        return kc.FP8
    raise ValueError(f"cupy kernels: a {kv_cache.dtype} KV cache with {dtype} values is not supported "
                     f"(the cache is the model's dtype, or float8_e4m3fn with {', '.join(kc.FP8_MODEL_DTYPES)})")

_streams: dict[int, object] = {}


def _stream():
    """torch's current stream as a cupy stream object (cached: one per stream)."""
    ptr = torch.cuda.current_stream().cuda_stream
    stream = _streams.get(ptr)
    if stream is None:
        import cupy
        stream = _streams[ptr] = cupy.cuda.ExternalStream(ptr)
    return stream


def _launch(source: str, expr: str, device: torch.device, grid: tuple[int, ...], args: tuple) -> None:
    kernel = kc.get_kernel(source, expr, device.index or 0)
    kernel.kernel(grid, (THREADS,), args, 0, _stream())


def _ptr(t: torch.Tensor) -> np.uint64:
    return np.uint64(t.data_ptr())


def _vector_rows(x: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] with heads D apart, contiguous elements and 16-byte aligned rows
    (what 16-byte vector loads need); a copy only if x is not already so."""
    es = x.element_size()
    ok = (x.stride(2) == 1 and x.stride(1) == x.shape[2] and (x.stride(0) * es) % 16 == 0
          and x.data_ptr() % 16 == 0)
    return x if ok else x.contiguous()


def _sinks_ptr(sinks: torch.Tensor | None) -> np.uint64:
    """The kernels' sinks argument: float32 [Hq] on the device, or null for none."""
    if sinks is None:
        return np.uint64(0)
    assert sinks.dtype == torch.float32 and sinks.is_contiguous() and sinks.is_cuda, "sinks: contiguous float32 on CUDA"
    return _ptr(sinks)


def _v_cache_ptr(kv_cache: torch.Tensor) -> np.uint64:
    return np.uint64(kv_cache.data_ptr() + kv_cache[0].numel() * kv_cache.element_size())


def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                      slot_mapping: torch.Tensor) -> None:
    """Write key/value [T, Hkv, D] into their slots of kv_cache; slot < 0 rows are skipped. An
    fp8 cache gets each value rounded to e4m3 (kv_format.py's convention)."""
    num_tokens, num_kv_heads, head_size = key.shape
    if num_tokens == 0:
        return
    assert slot_mapping.dtype == torch.int32 and kv_cache.is_contiguous(), "int32 slots, contiguous cache"
    key, value = _vector_rows(key), _vector_rows(value)
    kv = kv_dtype_name(kv_cache, key.dtype)
    if kv is not None:
        args = (_ptr(key), _ptr(value), _ptr(kv_cache), _v_cache_ptr(kv_cache), _ptr(slot_mapping),
                np.int64(key.stride(0)), np.int64(value.stride(0)), np.int32(num_kv_heads), np.int32(head_size),
                np.int32(kv_cache.shape[2]), np.int32(kv_cache.shape[3]))
        _launch("cache", kc.cache_expr(DTYPE_NAMES[key.dtype], kv), key.device, (num_tokens,), args)
        return
    es = key.element_size()
    args = (_ptr(key), _ptr(value), _ptr(kv_cache), _v_cache_ptr(kv_cache), _ptr(slot_mapping),
            np.int64(key.stride(0) * es // 16), np.int64(value.stride(0) * es // 16),
            np.int32(num_kv_heads), np.int32(head_size * es // 16),
            np.int32(kv_cache.shape[2]), np.int32(kv_cache.shape[3]))
    _launch("cache", kc.cache_expr(), key.device, (num_tokens,), args)


@dataclass(frozen=True)
class DecodePlan:
    """How one decode launch is laid out; fixed per step (and per captured graph)."""

    heads_per_cta: int  # GMAX: query heads of one group handled by a CTA
    num_chunks: int  # CTAs per KV head (group / heads_per_cta, rounded up)
    num_partitions: int  # 1: single pass; more: split-K, each partition_tokens long
    partition_tokens: int = PARTITION_TOKENS
    tensor_cores: bool = False  # decode_mma.cu (fp16/bf16; heads_per_cta 16) instead of decode.cu

    @property
    def split(self) -> bool:
        return self.num_partitions > 1


def plan_decode(batch: int, num_kv_heads: int, group: int, max_context: int, num_sms: int,
                tensor_cores: bool = False) -> DecodePlan:
    """Single pass when its CTAs alone cover every SM or contexts are short; otherwise
    split the context into the longest partitions that still give every SM a CTA (the
    shortest choice if none does), so that small batches with long contexts spread over
    the chip. `max_context` is an upper bound: with CUDA graphs it is max_model_len, and
    partitions past a sequence's end exit at once. `tensor_cores`: plan for decode_mma.cu
    (the caller checks the dtype: fp16/bf16)."""
    if tensor_cores:
        heads_per_cta = MMA_HEADS_PER_CTA
    else:
        heads_per_cta = min(MAX_HEADS_PER_CTA, 1 << (group - 1).bit_length())
    num_chunks = -(-group // heads_per_cta)
    ctas = batch * num_kv_heads * num_chunks
    if max_context <= PARTITION_CHOICES[-1] or ctas >= num_sms:
        return DecodePlan(heads_per_cta, num_chunks, 1, tensor_cores=tensor_cores)
    for tokens in PARTITION_CHOICES:
        parts = math.ceil(max_context / tokens)
        if parts > 1 and ctas * parts >= num_sms:
            break
    return DecodePlan(heads_per_cta, num_chunks, parts, tokens, tensor_cores)


def decode_kernel(plan: DecodePlan, dtype: str, head_size: int, block_size: int, kv_dtype: str | None = None
                  ) -> tuple[str, str]:
    """(source, instantiation) of the decode launch for this plan, dtype and cache type."""
    if plan.tensor_cores:
        assert dtype in kc.MMA_DTYPES and plan.heads_per_cta == MMA_HEADS_PER_CTA, f"tensor cores: {dtype}, {plan}"
        return "decode_mma", kc.decode_mma_expr(dtype, head_size, block_size, plan.split, kv_dtype)
    return "decode", kc.decode_expr(dtype, head_size, block_size, plan.heads_per_cta, plan.split, kv_dtype)


def decode_workspace_numel(batch: int, num_q_heads: int, head_size: int, plan: DecodePlan) -> int:
    """float32 elements of split-K scratch: partial out, max and sum per partition."""
    return 0 if not plan.split else batch * num_q_heads * plan.num_partitions * (head_size + 2)


def decode_attention(out: torch.Tensor, q: torch.Tensor, kv_cache: torch.Tensor,
                     block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                     plan: DecodePlan, workspace: torch.Tensor | None = None, window: int | None = None,
                     sinks: torch.Tensor | None = None) -> None:
    """out[b] = attention of q[b] ([B, Hq, D]) over its context_lens[b] cached tokens (the
    last `window` of them with a sliding window; earlier blocks are never read). `sinks`
    (float32 [Hq], gpt-oss): one more logit per head in each softmax, carrying no value.
    out must be contiguous; a context length of 0 gives zeros."""
    batch, num_q_heads, head_size = q.shape
    if batch == 0:
        return
    num_kv_heads, block_size = kv_cache.shape[1], kv_cache.shape[3]
    group = num_q_heads // num_kv_heads
    assert block_tables.dtype == context_lens.dtype == torch.int32 and out.is_contiguous(), \
        "int32 tables and lengths, contiguous out"
    q = _vector_rows(q)
    dtype = DTYPE_NAMES[q.dtype]
    parts = plan.num_partitions
    n = batch * num_q_heads * parts
    if plan.split:
        assert workspace is not None and workspace.numel() >= n * (head_size + 2), "split-K needs a workspace"
        part_out, part_max, part_sum = (_ptr(workspace), np.uint64(workspace.data_ptr() + 4 * n * head_size),
                                        np.uint64(workspace.data_ptr() + 4 * n * (head_size + 1)))
    else:
        part_out = part_max = part_sum = np.uint64(0)
    args = (_ptr(out), part_out, part_max, part_sum, _ptr(q), np.int64(q.stride(0)),
            _ptr(kv_cache), _v_cache_ptr(kv_cache), _ptr(block_tables), np.int32(block_tables.stride(0)),
            _ptr(context_lens), np.int32(kv_cache.shape[2]), np.int32(group), np.int32(plan.num_chunks),
            np.int32(plan.partition_tokens), np.float32(scale * LOG2E), np.int32(window or 0), _sinks_ptr(sinks))
    source, expr = decode_kernel(plan, dtype, head_size, block_size, kv_dtype_name(kv_cache, q.dtype))
    _launch(source, expr, q.device, (batch, num_kv_heads * plan.num_chunks, parts), args)
    if plan.split:
        args = (_ptr(out), part_out, part_max, part_sum, _ptr(context_lens), np.int32(parts),
                np.int32(plan.partition_tokens), _sinks_ptr(sinks))
        _launch("decode", kc.reduce_expr(dtype, head_size), q.device, (batch, num_q_heads), args)


@dataclass
class PrefillBatch:
    """A step's prefill chunks as the prefill kernel reads them (built once per step)."""

    tile_chunk: torch.Tensor  # [num_tiles] int32: chunk of each 16-row query tile
    tile_row0: torch.Tensor  # [num_tiles] int32: its first row (row = token * group + head)
    token_start: torch.Tensor  # [C] int32: chunk's first row in the flat token batch
    num_tokens: torch.Tensor  # [C] int32
    context_len: torch.Tensor  # [C] int32: cached + new tokens
    block_tables: torch.Tensor  # [C, W] int32, padded with 0
    num_tiles: int


def build_prefill_batch(chunks: list[tuple[int, int, int]], block_tables: torch.Tensor, group: int,
                        device: torch.device) -> PrefillBatch:
    """chunks: (token_start, num_tokens, context_len) each; block_tables: [C, W], row c chunk
    c's table, padded with 0."""
    tile_chunk, tile_row0 = [], []
    for c, (_, num_tokens, _) in enumerate(chunks):
        rows = range(0, num_tokens * group, PREFILL_ROWS)
        tile_chunk += [c] * len(rows)
        tile_row0 += rows
    host = torch.tensor(tile_chunk + tile_row0 + [x for chunk in chunks for x in chunk], dtype=torch.int32)
    dev = host.to(device, non_blocking=True)
    t, c = len(tile_chunk), len(chunks)
    per_chunk = dev[2 * t:].view(c, 3)
    tables = block_tables.to(device=device, dtype=torch.int32).contiguous()
    return PrefillBatch(dev[:t], dev[t:2 * t], per_chunk[:, 0].contiguous(), per_chunk[:, 1].contiguous(),
                        per_chunk[:, 2].contiguous(), tables, t)


def prefill_attention(out: torch.Tensor, q: torch.Tensor, kv_cache: torch.Tensor, batch: PrefillBatch,
                      scale: float, window: int | None = None, sinks: torch.Tensor | None = None) -> None:
    """Rows of `batch`'s chunks in out [T, Hq, D] (contiguous) = causal attention of
    their queries over each chunk's cached context, new tokens included (each query over the
    last `window` positions up to its own with a sliding window); `sinks` as decode's."""
    if batch.num_tiles == 0:
        return
    num_q_heads, head_size = q.shape[1], q.shape[2]
    num_kv_heads, block_size = kv_cache.shape[1], kv_cache.shape[3]
    q = _vector_rows(q)
    args = (_ptr(out), np.int64(out.stride(0)), _ptr(q), np.int64(q.stride(0)), _ptr(kv_cache),
            _v_cache_ptr(kv_cache), _ptr(batch.tile_chunk), _ptr(batch.tile_row0), _ptr(batch.token_start),
            _ptr(batch.num_tokens), _ptr(batch.context_len), _ptr(batch.block_tables),
            np.int32(batch.block_tables.stride(0)), np.int32(kv_cache.shape[2]),
            np.int32(num_q_heads // num_kv_heads), np.float32(scale * LOG2E), np.int32(window or 0), _sinks_ptr(sinks))
    expr = kc.prefill_expr(DTYPE_NAMES[q.dtype], head_size, block_size, kv_dtype_name(kv_cache, q.dtype))
    _launch("prefill", expr, q.device, (batch.num_tiles, num_kv_heads), args)


# -- the decoder's small per-layer ops (csrc/layers.cu), with cpu_kernels.ops' signatures -------

def _rows(x: torch.Tensor, name: str, weight: torch.Tensor | None = None) -> None:
    assert x.dim() == 2 and x.stride(1) == 1, f"{name}: x must be [T, N] with contiguous rows"
    assert weight is None or (weight.dtype == x.dtype and weight.is_contiguous()
                              and weight.numel() == x.shape[1]), f"{name}: weight must be x's dtype, [N]"


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's LlamaRMSNorm of each row of x [T, H] -> a new [T, H] tensor."""
    _rows(x, "rms_norm", weight)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if x.shape[0]:
        args = (_ptr(out), _ptr(x), _ptr(weight), np.float32(eps), np.int32(x.shape[1]), np.int64(x.stride(0)))
        _launch("layers", kc.layer_expr("rms_norm", DTYPE_NAMES[x.dtype]), x.device, (x.shape[0],), args)
    return out


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    """In place: residual = x + residual, then x = rms_norm(residual)."""
    _rows(x, "add_rms_norm", weight)
    assert residual.shape == x.shape and residual.stride(1) == 1 and residual.dtype == x.dtype, \
        "add_rms_norm: residual must match x"
    if x.shape[0]:
        args = (_ptr(x), _ptr(residual), _ptr(weight), np.float32(eps), np.int32(x.shape[1]),
                np.int64(x.stride(0)), np.int64(residual.stride(0)))
        _launch("layers", kc.layer_expr("add_rms_norm", DTYPE_NAMES[x.dtype]), x.device, (x.shape[0],), args)


def rotary(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int,
           head_dim: int) -> None:
    """In place: rotate-half rotary embedding of the first num_heads heads of each row of
    x [T, >= num_heads * head_dim], at positions [T] int64, from fp32 cos/sin tables [P, head_dim].
    Positions are not checked against the table here (that would wait for the device)."""
    _rows(x, "rotary")
    assert (positions.dtype == torch.int64 and positions.is_contiguous() and cos.dtype == sin.dtype == torch.float32
            and cos.is_contiguous() and sin.is_contiguous() and cos.shape[1] == head_dim), \
        "rotary: int64 positions, contiguous fp32 tables [P, head_dim]"
    if x.shape[0]:
        args = (_ptr(x), _ptr(positions), _ptr(cos), _ptr(sin), np.int32(num_heads), np.int32(head_dim),
                np.int64(x.stride(0)))
        _launch("layers", kc.layer_expr("rotary", DTYPE_NAMES[x.dtype]), x.device, (x.shape[0],), args)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2I] = [gate | up] -> silu(gate) * up [T, I]."""
    _rows(x, "silu_and_mul")
    inter = x.shape[1] // 2
    out = torch.empty((x.shape[0], inter), dtype=x.dtype, device=x.device)
    if x.shape[0]:
        args = (_ptr(out), _ptr(x), np.int32(inter), np.int64(x.stride(0)))
        _launch("layers", kc.layer_expr("silu_and_mul", DTYPE_NAMES[x.dtype]), x.device,
                (x.shape[0], -(-inter // THREADS)), args)
    return out
