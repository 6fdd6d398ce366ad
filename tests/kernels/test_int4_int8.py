"""The integer W4A8 kernel (cpu_kernels/csrc/int4_int8.cpp: int4 blocks x 8-bit activations)
bitwise against its plain-torch reference (int4_int8_format.reference) over a grid of shapes
and the int4 weights' kinds (GGUF Q4_0 and Q4_1, GPTQ's float32 zeros); the same bits for a
row alone, in any batch and at any thread count; its error against float32 activations times
the dequantized weights; its packed layout read back byte by byte. The module skips where the
kernel cannot run (no AVX512-VNNI, or no compiler)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from cpu_kernels import int4_int8_format, ops
from cpu_kernels.int4_int8_format import PackedInt4Int8
from cpu_kernels.quant_format import QuantizedTensor, quantize, unpack_int4
from test_quant_linear import assert_rows_do_not_depend_on_the_batch

if not ops.int4_int8_supported():
    pytest.skip("the integer int4 kernel needs AVX512-VNNI (or the kernels are unavailable)", allow_module_level=True)

ROWS = [1, 2, 7, 16, 33, 64]
# (N, K): one group, partial last groups (N off 16), odd group counts, SmolLM2's widths.
COLUMNS = [(16, 32), (40, 64), (33, 96), (200, 576), (17, 1536)]
# Relative error (Frobenius) against the exact product of the bf16 activations and the
# dequantized weights: the 8-bit activations (steps of 1/127 of each block's largest value)
# and the bf16 output.
MAX_RELATIVE_ERROR = 0.01  # measured: 0.0056-0.0060 at SmolLM2's shapes


def random_int4(n: int, k: int, kind: str = "q4_1", seed: int = 0) -> QuantizedTensor:
    """q4_1: fp16 scale and minimum; q4_0: zero = -8 * scale; gptq: zero = -scale * z in float32;
    fp32: float32 scales and zeros that fp16 does not hold."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=g)
    scales = (torch.rand(n, k // 32, generator=g) * 0.02 + 1e-4).half().float()
    if kind == "q4_0":
        zeros = -8 * scales
    elif kind == "gptq":
        zeros = -scales * torch.randint(0, 16, (n, k // 32), generator=g).float()
    elif kind == "fp32":
        scales, zeros = scales * (1 + 2.0**-20), -torch.rand(n, k // 32, generator=g) * 0.1
    else:
        zeros = (-torch.rand(n, k // 32, generator=g) * 0.1).half().float()
    return QuantizedTensor("int4", q, scales, zeros)


def run(x: torch.Tensor, w: QuantizedTensor, packed: PackedInt4Int8 | None = None) -> torch.Tensor:
    return ops.int4_int8_linear(x, packed or pack(w))


def pack(w: QuantizedTensor, encoding: str | None = None) -> PackedInt4Int8:
    return int4_int8_format.pack(w.qweight, w.scales, w.zeros, encoding)


def activations(m: int, k: int, seed: int = 1, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed)) * 3
    x[0, :32] = 0  # a block of zeros: d = 0
    if m > 1:
        x[1, :32] = 1e-6
        x[1, 5] = 1e4  # one large value rounds the rest of its block to 0
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n,k", COLUMNS)
@pytest.mark.parametrize("m", ROWS)
def test_bitwise_equal_to_reference(m, n, k, dtype):
    """float32 x gives the float32 sums themselves: every rounding of the float part checked.
    Each kind of weight in its own encoding (q4_*: fp16, gptq: units) and in fp32: the same bits."""
    for kind, encoding in (("q4_1", "fp16"), ("q4_0", "fp16"), ("gptq", "units"), ("fp32", "fp32")):
        w = random_int4(n, k, kind, seed=n + k)
        x = activations(m, k, seed=m, dtype=dtype)
        packed = pack(w)
        assert packed.encoding == encoding
        y = run(x, w, packed)
        assert y.dtype == dtype and y.shape == (m, n)
        assert torch.equal(y, int4_int8_format.reference(x, w.qweight, w.scales, w.zeros)), kind
        assert torch.equal(run(x, w, pack(w, "fp32")), y), kind


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rows_do_not_depend_on_the_batch(dtype):
    """A row alone, at every position in tiles of 4, with any neighbours, at 1 and 2 threads."""
    w = random_int4(200, 576, seed=1)
    packed = pack(w)
    x = torch.randn(70, 576, generator=torch.Generator().manual_seed(2)).to(dtype)
    assert_rows_do_not_depend_on_the_batch(lambda rows: run(rows.contiguous(), w, packed), x)


def test_threads_do_not_change_the_bits():
    w = random_int4(1000, 576, seed=3)
    packed = pack(w)
    x = torch.randn(33, 576, generator=torch.Generator().manual_seed(4))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        two = run(x, w, packed)
        torch.set_num_threads(1)
        one = run(x, w, packed)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)


def relative_error(m: int, n: int, k: int) -> float:
    weight = quantize(torch.randn(n, k, generator=torch.Generator().manual_seed(5)) * 0.05, "int4")
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(6)).bfloat16()
    exact = x.double() @ weight.dequantize().double().t()
    return float((run(x, weight).double() - exact).norm() / exact.norm())


@pytest.mark.parametrize("m,n,k", [(1, 576, 576), (16, 1536, 576), (7, 576, 1536)])
def test_error_against_float32(m, n, k):
    assert relative_error(m, n, k) < MAX_RELATIVE_ERROR


@pytest.mark.parametrize("encoding", ["fp32", "fp16", "units"])
def test_layout(encoding):
    """Each nibble lands where the kernel's header says: record (g, b), chunk h, byte 4c + t,
    low nibble for k = 32b + 4h + t, high for k + 16; then 16 scales and 16 zeros (units:
    zero / scale), float32 or fp16."""
    n, k = 20, 64
    w = random_int4(n, k, "gptq" if encoding == "units" else "q4_1", seed=7)
    values = unpack_int4(w.qweight)
    packed = pack(w, encoding)
    groups, blocks = 2, k // 32
    assert packed.data.numel() == groups * blocks * int4_int8_format.record_bytes(encoding)
    records = packed.data.view(groups, blocks, -1)
    nibbles = records[..., :256].reshape(groups, blocks, 4, 16, 4)
    half = torch.float32 if encoding == "fp32" else torch.float16
    floats = records[..., 256:].contiguous().view(half).float()
    scales, zeros = floats[..., :16], floats[..., 16:]
    want_zeros = w.zeros / w.scales if encoding == "units" else w.zeros
    for col in range(groups * 16):
        g, c = divmod(col, 16)
        for kk in range(k):
            b, hi, h, t = kk // 32, kk % 32 // 16, kk % 16 // 4, kk % 4
            byte = int(nibbles[g, b, h, c, t])
            want = int(values[col, kk]) if col < n else 0
            assert (byte >> 4 * hi) & 15 == want, (col, kk)
        for b in range(blocks):
            assert float(scales[g, b, c]) == (float(w.scales[col, b]) if col < n else 0.0)
            assert float(zeros[g, b, c]) == (float(want_zeros[col, b]) if col < n else 0.0)


def test_bad_inputs_are_refused():
    w = random_int4(16, 64)
    packed = pack(w)
    x = torch.randn(1, 64).bfloat16()
    with pytest.raises(RuntimeError, match="packed int4 weights"):
        ops.int4_int8_linear(x, dataclasses.replace(packed, data=packed.data[:-1].contiguous()))
    with pytest.raises(RuntimeError, match="packed int4 weights"):
        ops.int4_int8_linear(x, dataclasses.replace(packed, encoding="fp32"))
    with pytest.raises(RuntimeError, match="bfloat16 or float32"):
        ops.int4_int8_linear(x.half(), packed)
    with pytest.raises(ValueError, match="int4 weight"):
        int4_int8_format.pack(w.qweight, w.scales.half(), w.zeros)
    with pytest.raises(ValueError, match="not hold"):
        pack(random_int4(16, 64, "fp32"), "fp16")
