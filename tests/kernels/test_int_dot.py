"""The integer kernels (cpu_kernels/csrc/int_dot.cpp: int4 or int8 blocks x 8-bit activations;
on a CPU without AVX512-VNNI, csrc/int_dot_avx2.cpp's: whichever `ops.int_dot_linear` runs)
bitwise against their plain-torch reference (int_dot_format.reference) over a grid of shapes
and the weights' kinds (GGUF Q4_0, Q4_1 and Q8_0, GPTQ's float32 zeros, float32 scales); the
same bits for a row alone, in any batch and at any thread count; their error against the exact
product with the dequantized weights; the packed layout read byte by byte, and rows read back
from it. The module skips where no kernel runs (no AVX2, or no compiler)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from cpu_kernels import int_dot_format, ops
from cpu_kernels.int_dot_format import PackedIntDot
from cpu_kernels.quant_format import QuantizedTensor, quantize, unpack_int4
from test_quant_linear import assert_rows_do_not_depend_on_the_batch

if not ops.int_dot_supported():
    pytest.skip("the integer kernels need AVX2 (or the kernels are unavailable)", allow_module_level=True)

ROWS = [1, 2, 7, 16, 33, 64]
# (N, K): one group, partial last groups (N off 16), odd group counts, SmolLM2's widths.
COLUMNS = [(16, 32), (40, 64), (33, 96), (200, 576), (17, 1536)]
# Relative error (Frobenius) against the exact product of the bf16 activations and the
# dequantized weights: the 8-bit activations (steps of 1/127 of each block's largest value)
# and the bf16 output.
MAX_RELATIVE_ERROR = 0.01  # measured: 0.0056-0.0060 at SmolLM2's shapes
# Each kind of weight and the encoding `pack` picks for it.
KINDS = [("q4_1", "fp16"), ("q4_0", "fp16"), ("gptq", "units"), ("fp32", "fp32"), ("q8_0", "fp16"),
         ("int8_fp32", "fp32")]


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


def random_weight(n: int, k: int, kind: str, seed: int = 0) -> QuantizedTensor:
    """int4 kinds as random_int4; q8_0: fp16 scales, q in -127..127; int8_fp32: float32
    scales fp16 does not hold, q over all of -128..127."""
    if not kind.startswith(("q8", "int8")):
        return random_int4(n, k, kind, seed)
    g = torch.Generator().manual_seed(seed)
    low = -127 if kind == "q8_0" else -128
    q = torch.randint(low, 128, (n, k), dtype=torch.int8, generator=g)
    scales = (torch.rand(n, k // 32, generator=g) * 0.002 + 1e-5).half().float()
    if kind == "int8_fp32":
        scales = scales * (1 + 2.0**-20)
    return QuantizedTensor("int8", q, scales, None)


def run(x: torch.Tensor, w: QuantizedTensor, packed: PackedIntDot | None = None) -> torch.Tensor:
    return ops.int_dot_linear(x, packed or pack(w))


def pack(w: QuantizedTensor, encoding: str | None = None) -> PackedIntDot:
    return int_dot_format.pack(w, encoding)


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
    Each kind of weight in its own encoding (GGUF's: fp16, gptq: units) and in fp32: the same bits."""
    for kind, encoding in KINDS:
        w = random_weight(n, k, kind, seed=n + k)
        x = activations(m, k, seed=m, dtype=dtype)
        packed = pack(w)
        assert packed.encoding == encoding
        y = run(x, w, packed)
        assert y.dtype == dtype and y.shape == (m, n)
        assert torch.equal(y, int_dot_format.reference(x, w)), kind
        assert torch.equal(run(x, w, pack(w, "fp32")), y), kind


@pytest.mark.parametrize("fmt", ["q4_1", "q8_0"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rows_do_not_depend_on_the_batch(dtype, fmt):
    """A row alone, at every position in tiles of 4, with any neighbours, at 1 and 2 threads."""
    w = random_weight(200, 576, fmt, seed=1)
    packed = pack(w)
    x = torch.randn(70, 576, generator=torch.Generator().manual_seed(2)).to(dtype)
    assert_rows_do_not_depend_on_the_batch(lambda rows: run(rows.contiguous(), w, packed), x)


@pytest.mark.parametrize("fmt", ["q4_1", "q8_0"])
def test_threads_do_not_change_the_bits(fmt):
    w = random_weight(1000, 576, fmt, seed=3)
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


def relative_error(m: int, n: int, k: int, fmt: str) -> float:
    weight = quantize(torch.randn(n, k, generator=torch.Generator().manual_seed(5)) * 0.05, fmt)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(6)).bfloat16()
    exact = x.double() @ weight.dequantize().double().t()
    return float((run(x, weight).double() - exact).norm() / exact.norm())


@pytest.mark.parametrize("fmt", ["int4", "int8"])
@pytest.mark.parametrize("m,n,k", [(1, 576, 576), (16, 1536, 576), (7, 576, 1536)])
def test_error_against_float32(m, n, k, fmt):
    assert relative_error(m, n, k, fmt) < MAX_RELATIVE_ERROR


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
    assert packed.data.numel() == groups * blocks * int_dot_format.record_bytes("int4", encoding)
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


@pytest.mark.parametrize("encoding", ["fp32", "fp16"])
def test_int8_layout(encoding):
    """Record (g, b): chunk h, byte 4c + t = q + 128 for k = 32b + 4h + t; then 16 scales."""
    n, k = 20, 64
    w = random_weight(n, k, "q8_0", seed=8)
    packed = pack(w, encoding)
    groups, blocks = 2, k // 32
    assert packed.data.numel() == groups * blocks * int_dot_format.record_bytes("int8", encoding)
    records = packed.data.view(groups, blocks, -1)
    values = records[..., :512].reshape(groups, blocks, 8, 16, 4).int() - 128
    half = torch.float32 if encoding == "fp32" else torch.float16
    scales = records[..., 512:].contiguous().view(half).float()
    for col in range(groups * 16):
        g, c = divmod(col, 16)
        got = values[g, :, :, c, :].reshape(k)  # [b, h, t] -> k
        assert torch.equal(got, w.qweight[col].int() if col < n else torch.zeros(k, dtype=torch.int32)), col
        want = w.scales[col] if col < n else torch.zeros(blocks)
        assert torch.equal(scales[g, :, c], want), col


@pytest.mark.parametrize("kind,encoding", KINDS)
def test_rows_read_back(kind, encoding):
    """`int_dot_format.rows` gives the rows of the weight that was packed (a tied embedding)."""
    w = random_weight(40, 96, kind, seed=9)
    ids = torch.tensor([0, 39, 17, 17, 16, 15])
    got = int_dot_format.rows(pack(w), ids)
    assert got.format == w.format
    assert torch.equal(got.dequantize(), w.dequantize()[ids])


def test_bad_inputs_are_refused():
    w = random_int4(16, 64)
    packed = pack(w)
    x = torch.randn(1, 64).bfloat16()
    with pytest.raises(RuntimeError, match="packed weights"):
        run(x, w, dataclasses.replace(packed, data=packed.data[:-1].contiguous()))
    with pytest.raises(RuntimeError, match="packed weights"):
        run(x, w, dataclasses.replace(packed, encoding="fp32"))
    with pytest.raises(RuntimeError, match="bfloat16 or float32"):
        run(x.half(), w, packed)
    with pytest.raises(RuntimeError, match="encoding"):
        run(x, w, dataclasses.replace(pack(random_weight(16, 64, "q8_0")), encoding="units"))
    with pytest.raises(ValueError, match="float32 scales"):
        pack(dataclasses.replace(w, scales=w.scales.half()))
    with pytest.raises(ValueError, match="not hold"):
        pack(random_int4(16, 64, "fp32"), "fp16")
    with pytest.raises(ValueError, match="not hold"):
        pack(random_weight(16, 64, "int8_fp32"), "fp16")
