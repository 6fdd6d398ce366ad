"""Launchers for the CPU kernels: plain functions on torch CPU tensors.

Each checks its inputs once, in Python, where errors read well, then calls the op that
`csrc/<family>.cpp` registered under `torch.ops.pagedserve_cpu`. Callers check
`cpu_kernels.available(family)` first.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch

from cpu_kernels.compile import unavailable_reason
from cpu_kernels.int_dot_format import ENCODINGS
from cpu_kernels.quant_format import NIBBLE_FORMATS

if TYPE_CHECKING:
    from cpu_kernels.fp8_format import PackedFp8
    from cpu_kernels.int_dot_format import PackedIntDot


def _ensure(family: str) -> None:
    """Build or load `family` on first use (cached); raise if it cannot run here."""
    reason = unavailable_reason(family)
    if reason is not None:
        raise RuntimeError(f"CPU kernels {family!r} unavailable: {reason}")


# --- quant_linear: weight-only int4/int8 linear layers (csrc/quant_linear.cpp) ---------------

def int4_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor
                ) -> torch.Tensor:
    """x [M, K] float32 @ W^T, W [N, K] stored as GGUF-layout nibbles: qweight [N, K/2] uint8,
    w = scales * q + zeros per group of 32 (scales, zeros [N, K/32] float32)."""
    _ensure("quant_linear")
    _check_quant(x, qweight, scales, torch.uint8, 2)
    return torch.ops.pagedserve_cpu.int4_linear(x, qweight, scales, zeros)


def int8_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x [M, K] float32 @ W^T, W [N, K] = scales * qweight per group of 32 (qweight int8)."""
    _ensure("quant_linear")
    _check_quant(x, qweight, scales, torch.int8, 1)
    return torch.ops.pagedserve_cpu.int8_linear(x, qweight, scales)


def _check_quant(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, qdtype: torch.dtype,
                 values_per_byte: int) -> None:
    if x.dtype != torch.float32 or x.dim() != 2 or not x.is_contiguous():
        raise ValueError(f"x: want a contiguous 2-D float32 tensor, got {x.dtype} {tuple(x.shape)}")
    k = x.shape[1]
    if k % 32 or qweight.dtype != qdtype or qweight.shape[1] * values_per_byte != k:
        raise ValueError(f"qweight: want {qdtype} [N, {k // values_per_byte}] for K={k} (a multiple "
                         f"of 32), got {qweight.dtype} {tuple(qweight.shape)}")
    if scales.dtype != torch.float32 or tuple(scales.shape) != (qweight.shape[0], k // 32):
        raise ValueError(f"scales: want float32 [{qweight.shape[0]}, {k // 32}], got "
                         f"{scales.dtype} {tuple(scales.shape)}")


# --- quant_linear_bf16: the same formats for bf16 activations (csrc/quant_linear_bf16.cpp) ----

def bf16_dot_supported() -> bool:
    """Whether this CPU runs the bf16 quantized kernels (they need AVX512-BF16). Never raises."""
    from cpu_kernels.compile import available
    return available("quant_linear_bf16") and bool(torch.ops.pagedserve_cpu.bf16_supported())


def bf16_amx_ready() -> bool:
    """Whether this CPU and build run AMX tiles, the process holding the kernel's permission
    for their state (asked for on the first call). Never raises."""
    return bf16_dot_supported() and bool(torch.ops.pagedserve_cpu.bf16_amx_ready())


def bf16_quant_linear(x: torch.Tensor, fmt: str, records: torch.Tensor, n: int, amx: bool = False,
                      zero_units: bool = False) -> torch.Tensor:
    """x [M, K] bfloat16 (contiguous) @ W^T -> [M, n] bfloat16, W ("int4" | "int8" | "fp4") packed
    into `records` by `cpu_kernels.packing.pack`. `amx`: AMX arithmetic, x times the
    dequantized weights rounded to bf16, on tiles from 2 rows on (only where
    `bf16_amx_ready()`; a process picks one arithmetic for every call, see
    csrc/quant_linear_bf16.cpp). `zero_units`: the packed weight's (PackedWeight.zero_units).
    The op checks shapes and dtypes itself (in C++): this sits on every layer's hot path."""
    if fmt in NIBBLE_FORMATS:
        return torch.ops.pagedserve_cpu.bf16_int4_linear(x, records, n, amx, zero_units, fmt == "fp4")
    return torch.ops.pagedserve_cpu.bf16_int8_linear(x, records, n, amx)


def bf16_unpack(fmt: str, records: torch.Tensor, n: int, k: int, amx: bool = False,
                zero_units: bool = False) -> torch.Tensor:
    """A packed weight's bf16 values, unpacked once for `bf16_quant_linear_unpacked`: the
    quantized values, or for AMX arithmetic the dequantized weights rounded to bf16."""
    return torch.ops.pagedserve_cpu.bf16_unpack(records, n, k, fmt in NIBBLE_FORMATS, amx, zero_units, fmt == "fp4")


def bf16_quant_linear_unpacked(x: torch.Tensor, fmt: str, records: torch.Tensor, unpacked: torch.Tensor,
                               n: int, amx: bool = False, zero_units: bool = False) -> torch.Tensor:
    """`bf16_quant_linear`, reading the weights from `bf16_unpack`'s copy (the scales still
    from `records`): bitwise the same result, without unpacking per call."""
    return torch.ops.pagedserve_cpu.bf16_linear_unpacked(x, records, unpacked, n, fmt in NIBBLE_FORMATS, amx,
                                                         zero_units, fmt == "fp4")


def bf16_rows(fmt: str, records: torch.Tensor, n: int, k: int, ids: torch.Tensor,
              zero_units: bool = False) -> torch.Tensor:
    """Rows `ids` (int64 [T]) of a packed [n, k] weight, dequantized as
    QuantizedTensor.dequantize() does, in bfloat16 [T, k]: a tied embedding's lookup."""
    return torch.ops.pagedserve_cpu.bf16_rows(records, ids, n, k, fmt in NIBBLE_FORMATS, zero_units, fmt == "fp4")


# --- mxfp4_int8: MXFP4 weights x 8-bit activations, integer dot products (csrc/mxfp4_int8.cpp)

def int8_dot_supported() -> bool:
    """Whether this CPU runs the integer MXFP4 kernel (VPDPBUSD: AVX512-VNNI). Never raises."""
    from cpu_kernels.compile import available
    return available("mxfp4_int8") and bool(torch.ops.pagedserve_cpu.int8_dot_supported())


def mxfp4_int8_linear(x: torch.Tensor, packed: torch.Tensor, n: int) -> torch.Tensor:
    """x [M, K] bfloat16 (contiguous) @ W^T -> [M, n] bfloat16, W MXFP4 packed by
    `mxfp4_format.pack_int8`: the activations rounded to 8 bits per block of 32, then exact
    integer dot products (--cpu-arithmetic int8; the same bits for a row alone or in any
    batch). The op checks shapes and dtypes itself (in C++): it sits on the experts' hot path."""
    return torch.ops.pagedserve_cpu.mxfp4_int8_linear(x, packed, n)


# --- int_dot: int4/int8 weights x 8-bit activations, integer dot products (csrc/int_dot.cpp) ---

def int_dot_kernel() -> str | None:
    """Which integer kernels run here, the widest first (each gives the same bits, so the choice
    is speed alone; measured 1.3-2.6x between AVX512-VNNI and AVX2, docs/cpu.md):
    "avx512_vnni" (csrc/int_dot.cpp), "avx_vnni" or "avx2" (csrc/int_dot_avx2.cpp); None
    where none does. Never raises."""
    return _int_dot_choice()[0]


@functools.cache
def _int_dot_choice() -> tuple[str | None, dict]:
    """(the kernel's name, format -> its op), once per process."""
    from cpu_kernels.compile import available
    kernels = torch.ops.pagedserve_cpu if available("int_dot") or available("int_dot_avx2") else None
    if available("int_dot") and kernels.int_dot_avx512_supported():
        return "avx512_vnni", {"int4": kernels.int4_int8_linear, "int8": kernels.int8_int8_linear}
    if int_dot_avxvnni_supported():
        return "avx_vnni", {"int4": kernels.int4_int8_linear_avxvnni, "int8": kernels.int8_int8_linear_avxvnni}
    if int_dot_avx2_supported():
        return "avx2", {"int4": kernels.int4_int8_linear_avx2, "int8": kernels.int8_int8_linear_avx2}
    return None, {}


def int_dot_supported() -> bool:
    """Whether this CPU runs one of the integer int4/int8 kernels (`int_dot_kernel`). Never raises."""
    return int_dot_kernel() is not None


def int_dot_linear(x: torch.Tensor, packed: PackedIntDot) -> torch.Tensor:
    """x [M, K] bfloat16 or float32 (contiguous) @ W^T -> [M, N] of x's dtype, W an int4 or int8
    weight packed by `int_dot_format.pack`: the activations rounded to 8 bits per block of 32,
    exact integer dot products, then one fixed float order per output (the same bits for a row
    alone or in any batch, with any of the kernels; `int_dot_format.reference` computes them).
    Refuses (RuntimeError) where `int_dot_supported()` is false; the op checks shapes and
    dtypes itself (in C++)."""
    return _int_dot_op(packed.fmt)(x, packed.data, packed.n, ENCODINGS.index(packed.encoding))


def int_dot_op_name(fmt: str) -> str:
    """The qualified name of the op `int_dot_linear` calls for an `fmt` ("int4" or "int8")
    weight, for C++ callers (csrc/decode_layers.cpp). Refuses as `int_dot_linear` does."""
    return _int_dot_op(fmt)._qualified_op_name


def _int_dot_op(fmt: str):
    """The widest integer kernel's op for `fmt` weights; RuntimeError where none runs."""
    name, ops_by_format = _int_dot_choice()
    if name is None:
        raise RuntimeError("the integer kernels need AVX2 (or AVX512-VNNI / AVX-VNNI); this CPU or build lacks them")
    return ops_by_format[fmt]


def int_dot_avx512_linear(x: torch.Tensor, packed: PackedIntDot) -> torch.Tensor:
    """`int_dot_linear` on the AVX512-VNNI kernel itself (tests compare the kernels)."""
    _ensure("int_dot")
    kernels = torch.ops.pagedserve_cpu
    op = kernels.int4_int8_linear if packed.fmt == "int4" else kernels.int8_int8_linear
    return op(x, packed.data, packed.n, ENCODINGS.index(packed.encoding))


# --- int_dot_avx2: the same ops in AVX2 or AVX-VNNI, the same bits (csrc/int_dot_avx2.cpp) ---

def int_dot_avx2_supported() -> bool:
    """Whether this CPU runs the AVX2 integer int4/int8 kernels (AVX2 and F16C). Never raises."""
    from cpu_kernels.compile import available
    return available("int_dot_avx2") and bool(torch.ops.pagedserve_cpu.int_dot_avx2_supported())


def int_dot_avxvnni_supported() -> bool:
    """Whether it also runs their AVX-VNNI variant (256-bit VPDPBUSD: Intel's cores from Alder Lake
    on). Never raises."""
    return int_dot_avx2_supported() and bool(torch.ops.pagedserve_cpu.int_dot_avxvnni_supported())


def int_dot_avx2_linear(x: torch.Tensor, packed: PackedIntDot, vnni: bool = False) -> torch.Tensor:
    """`int_dot_linear` in AVX2 instructions (`vnni`: AVX-VNNI's), on the same packed weight:
    the same bits as it and `int_dot_format.reference`. Refuses (RuntimeError) where
    `int_dot_avx2_supported()` (or `int_dot_avxvnni_supported()`) is false."""
    _ensure("int_dot_avx2")
    kernels = torch.ops.pagedserve_cpu
    if packed.fmt == "int4":
        op = kernels.int4_int8_linear_avxvnni if vnni else kernels.int4_int8_linear_avx2
    else:
        op = kernels.int8_int8_linear_avxvnni if vnni else kernels.int8_int8_linear_avx2
    return op(x, packed.data, packed.n, ENCODINGS.index(packed.encoding))


# --- paged_attention: decode reading K/V blocks in place (csrc/paged_attention.cpp) ---------

ATTENTION_DTYPES = (torch.float32, torch.bfloat16)  # the queries', and a float cache's
# The caches the kernels read: float ones of q's dtype, and int8 ones (--kv-cache-dtype int8:
# rows of D values and a bf16 scale, csrc/paged_attention_int8.cpp) under either q.
KV_CACHE_DTYPES = (*ATTENTION_DTYPES, torch.int8)
INT8_SCALE_BYTES = 2  # engine/attention/kv_format.py's: an int8 row is D + 2 bytes


def int8_kv_available() -> bool:
    """Whether the int8 cache's kernels load here (with the float ones). Never raises."""
    from cpu_kernels.compile import available
    return available("paged_attention") and available("paged_attention_int8")


def paged_decode(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                 context_lens: torch.Tensor, scale: float, window: int | None = None,
                 sinks: torch.Tensor | None = None) -> torch.Tensor:
    """out [B, Hq, D] (q's dtype): q [B, Hq, D] attends to its sequence's context_lens[b]
    cached tokens, found through block_tables [B, W] int64 in kv_cache [2, Hkv, N, bs, D] (of q's
    dtype, or int8 [..., D + 2]: values and a bf16 scale per row, dequantized in registers);
    with a sliding `window`, to the last `window` of them only (earlier table entries are
    never read). `sinks` (float32 [Hq]): a logit per head that joins each softmax's
    denominator and adds no value (gpt-oss).
    q's rows may be strided (a view of the fused qkv); its heads must be D apart."""
    _ensure("paged_attention")
    if q.dim() != 3 or q.dtype not in ATTENTION_DTYPES or q.device.type != "cpu":
        raise ValueError(f"q: want a CPU float32/bfloat16 [B, Hq, D] tensor, got {q.dtype} "
                         f"{tuple(q.shape)} on {q.device}")
    batch, num_heads, dim = q.shape
    if q.stride(2) != 1 or q.stride(1) != dim:
        raise ValueError(f"q: heads must be D={dim} elements apart and contiguous, got strides {q.stride()}")
    if kv_cache.dtype == torch.int8:
        _ensure("paged_attention_int8")
    row = dim + INT8_SCALE_BYTES if kv_cache.dtype == torch.int8 else dim
    if (kv_cache.dim() != 5 or kv_cache.shape[0] != 2 or kv_cache.shape[4] != row
            or kv_cache.dtype not in (q.dtype, torch.int8) or not kv_cache.is_contiguous()):
        raise ValueError(f"kv_cache: want a contiguous {q.dtype} [2, Hkv, num_blocks, block_size, {dim}] "
                         f"(or int8 [..., {dim + INT8_SCALE_BYTES}]) tensor, got {kv_cache.dtype} "
                         f"{tuple(kv_cache.shape)}")
    if dim % 8 or num_heads % kv_cache.shape[1]:
        raise ValueError(f"head_dim {dim} must be a multiple of 8 and Hq={num_heads} a multiple of "
                         f"Hkv={kv_cache.shape[1]}")
    if (block_tables.dtype != torch.int64 or block_tables.dim() != 2 or block_tables.shape[0] != batch
            or not block_tables.is_contiguous()):
        raise ValueError(f"block_tables: want contiguous int64 [{batch}, W], got {block_tables.dtype} "
                         f"{tuple(block_tables.shape)}")
    if context_lens.dtype != torch.int64 or tuple(context_lens.shape) != (batch,) or not context_lens.is_contiguous():
        raise ValueError(f"context_lens: want contiguous int64 [{batch}], got {context_lens.dtype} "
                         f"{tuple(context_lens.shape)}")
    if window is not None and window < 1:
        raise ValueError(f"window: want a positive number of tokens or None, got {window}")
    return torch.ops.pagedserve_cpu.paged_decode(q, kv_cache, block_tables, context_lens, float(scale),
                                                 window or 0, sinks)


def paged_decode_bf16_dot() -> bool:
    """Whether bfloat16 decode runs on VDPBF16PS here (a build with AVX512-BF16: exact bf16
    products, each probability split into two bf16 parts for the V product), rather than on
    AVX2 float arithmetic over widened values. Never raises."""
    from cpu_kernels.compile import available
    return available("paged_attention") and bool(torch.ops.pagedserve_cpu.paged_decode_bf16_dot())


def reshape_and_cache(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write k, v [T, Hkv, D] (rows may be strided) into kv_cache [2, Hkv, N, bs, D] at
    slot_mapping [<= T] int64; rows past it are padding. An int8 cache [..., D + 2] gets each
    row quantized (kv_format.quantize_int8's bits; its family loaded by `int8_kv_available`,
    which callers check once). The op checks its inputs."""
    torch.ops.pagedserve_cpu.reshape_and_cache(k, v, kv_cache, slot_mapping)


# --- layer_ops: a decoder layer's small operations, fused (csrc/layer_ops.cpp) --------------
# Rows [T, H] may be strided; elements within a row contiguous. float32 or bfloat16. The ops
# check their inputs in C++; these run several times per layer, so nothing is checked here.

def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's LlamaRMSNorm of each row of x [T, H] -> a new [T, H] tensor."""
    return torch.ops.pagedserve_cpu.rms_norm(x, weight, eps)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    """In place: residual = x + residual, then x = rms_norm(residual)."""
    torch.ops.pagedserve_cpu.add_rms_norm(x, residual, weight, eps)


def rotary(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int,
           head_dim: int) -> None:
    """In place: rotate-half rotary embedding of the first num_heads heads of each row of
    x [T, >= num_heads * head_dim], at positions [T] int64, from fp32 cos/sin tables [P, head_dim]."""
    torch.ops.pagedserve_cpu.rotary(x, positions, cos, sin, num_heads, head_dim)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2I] = [gate | up] -> silu(gate) * up [T, I]."""
    return torch.ops.pagedserve_cpu.silu_and_mul(x)


def clamped_swiglu(x: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's activation: x [T, 2I] = [gate | up] -> (clamp(up, -limit, limit) + 1) * g *
    sigmoid(alpha * g), g = min(gate, limit): [T, I]."""
    return torch.ops.pagedserve_cpu.clamped_swiglu(x, alpha, limit)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    """In place: logits[rows[r], t] = -inf where bit t of bitmask[r] (int32 [R, ceil(V/32)]) is 0."""
    torch.ops.pagedserve_cpu.apply_token_bitmask(logits, bitmask, rows)


# --- fp8_linear: FP8 e4m3 weights, one byte each (csrc/fp8_linear.cpp) -----------------------

def fp8_supported() -> bool:
    """Whether the FP8 kernel runs here with float32 activations (it needs AVX-512 F, BW and
    VBMI: Ice Lake, Sapphire Rapids, Zen 4 and later). Never raises."""
    from cpu_kernels.compile import available
    return available("fp8_linear") and bool(torch.ops.pagedserve_cpu.fp8_supported())


def fp8_bf16_supported() -> bool:
    """Whether it also runs bfloat16 activations (VDPBF16PS: AVX512-BF16). Never raises."""
    return fp8_supported() and bool(torch.ops.pagedserve_cpu.fp8_bf16_supported())


def fp8_amx_ready() -> bool:
    """Whether it runs AMX tiles here, the process holding the tile state's permission."""
    return fp8_bf16_supported() and bool(torch.ops.pagedserve_cpu.fp8_amx_ready())


def fp8_linear(x: torch.Tensor, packed: PackedFp8, amx: bool = False, out_dtype: torch.dtype | None = None
               ) -> torch.Tensor:
    """x [M, K] (contiguous) @ W^T -> [M, N], W an FP8 weight packed by
    `cpu_kernels.fp8_format.pack`, widened to exact values in registers, never dequantized in
    memory. float32 x: fp32 fmas, float32 out. bfloat16 x: VDPBF16PS, or in AMX arithmetic
    (`amx`, where `fp8_amx_ready()`; one arithmetic per process) tiles from 2 rows on; bfloat16
    out, or float32 (`out_dtype`: the fp32 sums before rounding). Either way x times
    fp8 * scale up to fp32 summation order (csrc/fp8_linear.cpp). The op checks its inputs."""
    _ensure("fp8_linear")
    return torch.ops.pagedserve_cpu.fp8_linear(x, packed.data, packed.scales, packed.n, packed.k_block, amx,
                                               out_dtype)
