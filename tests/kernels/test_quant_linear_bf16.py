"""The bf16 quantized linear kernels (cpu_kernels/csrc/quant_linear_bf16.cpp) against the
float64 product of the bf16 activations with the exact effective weights, their packed
layout (cpu_kernels/packing.py) against the row layout, and batch invariance across the
register path (few rows) and the panel path (16 rows and more). They need AVX512-BF16:
elsewhere the module skips. Each test runs in both arithmetics: VDPBF16PS (exact effective
weights, factored per block), and AMX's (the weights dequantized to bf16; tiles from 2 rows
on, the split register path for one row), which skips where the CPU has no AMX or the
kernel refuses this process the tile state."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cpu_kernels import ops, packing
from cpu_kernels.quant_format import QuantizedTensor, from_mxfp4, quantize, reference_linear
from test_quant_linear import assert_rows_do_not_depend_on_the_batch, gptq_like_weight, random_weight

if not ops.bf16_dot_supported():
    pytest.skip("bf16 quantized kernels need AVX512-BF16 (or the kernels are unavailable)", allow_module_level=True)

needs_amx = pytest.mark.skipif(not ops.bf16_amx_ready(), reason="no AMX tiles on this CPU, or no permission")
ARITHMETICS = [pytest.param(False, id="vdpbf16"), pytest.param(True, id="amx", marks=needs_amx)]

# N: one group, not a multiple of 16, a narrow last super-group, many super-groups.
SHAPES = [(1, 16, 32), (1, 600, 576), (2, 130, 96), (3, 96, 576), (5, 576, 1536), (15, 200, 64),
          (16, 200, 64), (17, 130, 96), (40, 328, 576), (130, 512, 576)]


def run(x: torch.Tensor, packed: packing.PackedWeight, amx: bool = False) -> torch.Tensor:
    return ops.bf16_quant_linear(x.contiguous(), packed.format, packed.data, packed.n, amx)


def bf16_input(m: int, k: int, seed: int = 1) -> torch.Tensor:
    return (torch.randn(m, k, generator=torch.Generator().manual_seed(seed)) * 3).bfloat16()


@pytest.mark.parametrize("amx", ARITHMETICS)
@pytest.mark.parametrize("fmt", ["int4", "int8"])
@pytest.mark.parametrize("m,n,k", SHAPES)
def test_kernel_matches_reference(fmt, m, n, k, amx):
    """Within one bf16 rounding of the exact result: fp32 accumulation of exact products (of
    the effective weights; in AMX arithmetic, of those rounded to bf16)."""
    w = random_weight(fmt, n, k)
    x = bf16_input(m, k)
    x[0, :32] = 0
    out = run(x, packing.pack(w), amx).float()
    ref = (x.double() @ w.dequantize().bfloat16().double().t()).float() if amx else reference_linear(x.float(), w)
    assert out.shape == (m, n) and torch.isfinite(out).all()
    one_ulp = ref.abs() * 2.0 ** -8 + 1e-6 * ref.abs().max()
    assert ((out - ref).abs() <= one_ulp).all()
    assert (out == ref.bfloat16().float()).float().mean() > 0.99  # mostly the rounded exact value


@pytest.mark.parametrize("amx", ARITHMETICS)
@pytest.mark.parametrize("fmt", ["int4", "int8"])
def test_rows_do_not_depend_on_the_batch(fmt, amx):
    """Bitwise: a row alone (register path), in small tiles, and among 16+ rows (panel path;
    in AMX arithmetic: alone, the split register path; 2 rows on, tiles with padded rows)."""
    w = packing.pack(random_weight(fmt, 328, 576))
    x = bf16_input(70, 576, seed=2)
    assert_rows_do_not_depend_on_the_batch(lambda rows: run(rows, w, amx), x)


def amx_arithmetic(x: torch.Tensor, w: QuantizedTensor) -> torch.Tensor:
    """csrc/quant_linear_bf16.cpp's AMX arithmetic, one float32 operation at a time (numpy
    rounds each): weights dequantized and rounded to bf16; per block, the even-k and the
    odd-k products each summed in k order, then acc = acc + (even + odd)."""
    xs = x.float().numpy()
    ws = w.dequantize().bfloat16().float().numpy()
    out = np.zeros((xs.shape[0], ws.shape[0]), dtype=np.float32)
    for m in range(xs.shape[0]):
        for n in range(ws.shape[0]):
            acc = np.float32(0)
            for b in range(0, xs.shape[1], 32):
                even = odd = np.float32(0)
                for k in range(b, b + 32, 2):
                    even = np.float32(even + xs[m, k] * ws[n, k])
                    odd = np.float32(odd + xs[m, k + 1] * ws[n, k + 1])
                acc = np.float32(acc + np.float32(even + odd))
            out[m, n] = acc
    return torch.from_numpy(out).bfloat16()


@needs_amx
@pytest.mark.parametrize("fmt", ["int4", "int8"])
def test_amx_arithmetic_is_the_documented_one(fmt):
    """Bitwise, one row (the split register path) and 5 rows (tiles), against the arithmetic
    written out; x's first block (2^12, 1, -2^12, 1, ...) makes one running sum (VDPBF16PS's
    order) round differently from separate even and odd sums."""
    w = random_weight(fmt, 20, 64)
    x = bf16_input(5, 64, seed=4)
    x[:, 0:32:4], x[:, 1:32:2], x[:, 2:32:4] = 2.0 ** 12, 1.0, -(2.0 ** 12)
    packed = packing.pack(w)
    expected = amx_arithmetic(x, w)
    assert torch.equal(run(x, packed, True), expected)
    assert torch.equal(run(x[:1], packed, True), expected[:1])
    assert not torch.equal(run(x, packed, False), expected)  # the two arithmetics do differ here


@pytest.mark.parametrize("fmt", ["int4", "int8"])
@pytest.mark.parametrize("n,k", [(16, 32), (130, 96), (328, 64)])
def test_pack_round_trips(fmt, n, k):
    w = random_weight(fmt, n, k)
    packed = packing.pack(w)
    back = packing.unpack(packed)
    assert torch.equal(back.qweight, w.qweight) and torch.equal(back.scales, w.scales)
    assert (back.zeros is None) == (w.zeros is None)
    if w.zeros is not None:
        assert torch.equal(back.zeros, w.zeros)
    rows = torch.tensor([n - 1, 0, n // 2, n - 1])
    some = packing.unpack_rows(packed, rows)
    assert torch.equal(some.dequantize(), w.dequantize()[rows])


def test_quantize_gives_fp16_exact_int4_scales():
    weight = torch.randn(40, 64, generator=torch.Generator().manual_seed(3))
    q = quantize(weight, "int4")
    assert torch.equal(q.scales.half().float(), q.scales) and torch.equal(q.zeros.half().float(), q.zeros)
    assert torch.equal(packing.unpack(packing.pack(q)).dequantize(), q.dequantize())


def test_pack_refuses_scales_fp16_cannot_hold():
    w = random_weight("int4", 16, 32)
    bad = QuantizedTensor("int4", w.qweight, w.scales + 1e-7, w.zeros)
    with pytest.raises(ValueError, match="fp16"):
        packing.pack(bad)


def test_op_rejects_bad_inputs():
    packed = packing.pack(random_weight("int4", 32, 64))
    with pytest.raises(RuntimeError, match="bfloat16"):
        ops.bf16_quant_linear(torch.zeros(2, 64), "int4", packed.data, 32)
    with pytest.raises(RuntimeError, match="packed weights"):
        ops.bf16_quant_linear(torch.zeros(2, 64, dtype=torch.bfloat16), "int4", packed.data, 48)


@pytest.mark.parametrize("fmt", ["int4", "int8"])
def test_rows_dequantize_as_the_reference(fmt):
    """The tied embedding's lookup: rows of the packed table, bitwise as dequantize() gives them."""
    w = random_weight(fmt, 130, 96)
    ids = torch.tensor([129, 0, 17, 17, 64])
    rows = ops.bf16_rows(fmt, packing.pack(w).data, 130, 96, ids)
    assert torch.equal(rows, w.dequantize()[ids].bfloat16())
    with pytest.raises(RuntimeError, match="out of range"):
        ops.bf16_rows(fmt, packing.pack(w).data, 130, 96, torch.tensor([130]))


@pytest.mark.parametrize("amx", ARITHMETICS)
@pytest.mark.parametrize("fmt", ["int4", "int8"])
@pytest.mark.parametrize("m", [1, 3, 5, 16, 40, 130])
def test_unpacked_copy_gives_the_same_bits(fmt, m, amx):
    """The once-unpacked weights (QuantLinear keeps them for int8) change the speed, never a bit."""
    w = packing.pack(random_weight(fmt, 328, 576))
    unpacked = ops.bf16_unpack(fmt, w.data, w.n, 576, amx)  # AMX: the dequantized weights
    x = bf16_input(m, 576, seed=3)
    assert torch.equal(ops.bf16_quant_linear_unpacked(x, fmt, w.data, unpacked, w.n, amx), run(x, w, amx))


def test_amx_refused_where_it_cannot_run():
    """Asking for AMX arithmetic where the tiles cannot run is an error, never a trap."""
    if ops.bf16_amx_ready():
        pytest.skip("this CPU runs AMX tiles")
    packed = packing.pack(random_weight("int4", 32, 64))
    with pytest.raises(RuntimeError, match="AMX"):
        ops.bf16_quant_linear(torch.zeros(2, 64, dtype=torch.bfloat16), "int4", packed.data, 32, True)


def test_gptq_zeros_are_held_in_scale_units():
    """-s * z needs 15 significant bits: the packed layer holds -z and restores the same floats."""
    w = gptq_like_weight(200, 256)
    assert not torch.equal(w.zeros.half().float(), w.zeros)
    assert packing.zero_encoding(w) == "units"
    packed = packing.pack(w)
    assert packed.zero_units and torch.equal(packing.unpack(packed).dequantize(), w.dequantize())
    bad = QuantizedTensor("int4", w.qweight, w.scales, w.zeros + 1e-4)  # not a multiple of the scale
    assert packing.zero_encoding(bad) is None
    tiny = QuantizedTensor("int4", w.qweight, w.scales * 2**-20, w.zeros * 2**-20)  # below fp16's range
    assert packing.zero_encoding(tiny) is None


@pytest.mark.parametrize("amx", ARITHMETICS)
def test_zero_encodings_give_the_same_bits(amx):
    """Zeros that both encodings hold (-8 * s: symmetric GPTQ) give bitwise the same outputs,
    rows and unpacked copies either way: scale units change the bytes, never the arithmetic."""
    w = gptq_like_weight(130, 256)
    w = QuantizedTensor("int4", w.qweight, w.scales, -8 * w.scales)
    fp16, units = packing.pack(w, "fp16"), packing.pack(w, "units")
    assert not units.zero_units or not torch.equal(fp16.data, units.data)
    for m in (1, 3, 16, 40):
        x = bf16_input(m, 256, seed=m)
        ours = ops.bf16_quant_linear(x, "int4", units.data, 130, amx, zero_units=True)
        assert torch.equal(ours, run(x, fp16, amx))
        copy = ops.bf16_unpack("int4", units.data, 130, 256, amx, zero_units=True)
        same = ops.bf16_quant_linear_unpacked(x, "int4", units.data, copy, 130, amx, zero_units=True)
        assert torch.equal(same, ours)
    ids = torch.tensor([0, 129, 7])
    assert torch.equal(ops.bf16_rows("int4", units.data, 130, 256, ids, zero_units=True),
                       ops.bf16_rows("int4", fp16.data, 130, 256, ids))


@pytest.mark.parametrize("amx", ARITHMETICS)
def test_gptq_zeros_match_the_reference(amx):
    """Asymmetric GPTQ/AWQ weights on the kernels: within one bf16 rounding of the exact
    product, and each row the same alone or in a batch."""
    w = gptq_like_weight(328, 512, seed=2)
    packed = packing.pack(w)
    x = bf16_input(40, 512)
    out = ops.bf16_quant_linear(x, "int4", packed.data, 328, amx, zero_units=True).float()
    ref = (x.double() @ w.dequantize().bfloat16().double().t()).float() if amx else reference_linear(x.float(), w)
    assert ((out - ref).abs() <= ref.abs() * 2.0 ** -8 + 1e-6 * ref.abs().max()).all()
    for m in (1, 5):
        alone = ops.bf16_quant_linear(x[:m].contiguous(), "int4", packed.data, 328, amx, zero_units=True)
        assert torch.equal(alone, out[:m].bfloat16())


def mxfp4_weight(n: int, k: int, seed: int = 0) -> QuantizedTensor:
    """MXFP4 as gpt-oss ships it, random codes and exponents 2^-12..2^1, as an fp4 weight."""
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (n, k // 32, 16), dtype=torch.uint8, generator=g)
    scales = torch.randint(127 - 12, 127 + 2, (n, k // 32), dtype=torch.uint8, generator=g)
    return from_mxfp4(blocks, scales)


def test_fp4_is_mxfp4_in_our_nibble_order():
    from cpu_kernels import mxfp4_format
    g = torch.Generator().manual_seed(1)
    blocks = torch.randint(0, 256, (24, 3, 16), dtype=torch.uint8, generator=g)
    scales = torch.randint(127 - 24, 127 + 15, (24, 3), dtype=torch.uint8, generator=g)  # fp16's powers of two
    w = from_mxfp4(blocks, scales)
    assert torch.equal(w.dequantize(), mxfp4_format.dequantize(blocks, scales))
    tiny = from_mxfp4(blocks, torch.full_like(scales, 127 - 25))  # 2^-25: below fp16, not packable
    assert packing.zero_encoding(tiny) is None
    packed = packing.pack(w)
    assert packed.format == "fp4" and not packed.zero_units
    assert torch.equal(packing.unpack(packed).dequantize(), w.dequantize())


@pytest.mark.parametrize("amx", ARITHMETICS)
@pytest.mark.parametrize("m", [1, 3, 16, 40])
def test_fp4_matches_the_reference_and_the_batch(amx, m):
    """e2m1 codes through the int4 kernels' other table: within one bf16 rounding of the exact
    product (every e2m1 x bf16 product is exact), each row the same alone as in the batch,
    the unpacked copy and the rows op bitwise what they are for int4."""
    w = mxfp4_weight(200, 576, seed=m)
    packed = packing.pack(w)
    x = bf16_input(m, 576, seed=m)
    out = run(x, packed, amx).float()
    ref = (x.double() @ w.dequantize().bfloat16().double().t()).float() if amx else reference_linear(x.float(), w)
    assert ((out - ref).abs() <= ref.abs() * 2.0 ** -8 + 1e-6 * ref.abs().max()).all()
    assert torch.equal(run(x[:1].contiguous(), packed, amx), out[:1].bfloat16())
    copy = ops.bf16_unpack("fp4", packed.data, 200, 576, amx)
    assert torch.equal(ops.bf16_quant_linear_unpacked(x, "fp4", packed.data, copy, 200, amx), out.bfloat16())
    ids = torch.tensor([0, 199, 57])
    assert torch.equal(ops.bf16_rows("fp4", packed.data, 200, 576, ids), w.dequantize()[ids].bfloat16())
