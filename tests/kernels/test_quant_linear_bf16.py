"""The bf16 quantized linear kernels (cpu_kernels/csrc/quant_linear_bf16.cpp) against the
float64 product of the bf16 activations with the exact effective weights, their packed
layout (cpu_kernels/packing.py) against the row layout, and batch invariance across the
register path (few rows) and the panel path (16 rows and more). They need AVX512-BF16:
elsewhere the module skips."""

from __future__ import annotations

import pytest
import torch

from cpu_kernels import ops, packing
from cpu_kernels.quant_format import QuantizedTensor, quantize, reference_linear
from test_quant_linear import random_weight

if not ops.bf16_dot_supported():
    pytest.skip("bf16 quantized kernels need AVX512-BF16 (or the kernels are unavailable)", allow_module_level=True)

# N: one group, not a multiple of 16, a narrow last super-group, many super-groups.
SHAPES = [(1, 16, 32), (1, 600, 576), (2, 130, 96), (3, 96, 576), (5, 576, 1536), (15, 200, 64),
          (16, 200, 64), (17, 130, 96), (40, 328, 576), (130, 512, 576)]


def run(x: torch.Tensor, packed: packing.PackedWeight) -> torch.Tensor:
    return ops.bf16_quant_linear(x.contiguous(), packed.format, packed.data, packed.n)


def bf16_input(m: int, k: int, seed: int = 1) -> torch.Tensor:
    return (torch.randn(m, k, generator=torch.Generator().manual_seed(seed)) * 3).bfloat16()


@pytest.mark.parametrize("fmt", ["int4", "int8"])
@pytest.mark.parametrize("m,n,k", SHAPES)
def test_kernel_matches_reference(fmt, m, n, k):
    """Within one bf16 rounding of the exact result: fp32 accumulation of exact products."""
    w = random_weight(fmt, n, k)
    x = bf16_input(m, k)
    x[0, :32] = 0
    out = run(x, packing.pack(w)).float()
    ref = reference_linear(x.float(), w)
    assert out.shape == (m, n) and torch.isfinite(out).all()
    one_ulp = ref.abs() * 2.0 ** -8 + 1e-6 * ref.abs().max()
    assert ((out - ref).abs() <= one_ulp).all()
    assert (out == ref.bfloat16().float()).float().mean() > 0.99  # mostly the rounded exact value


@pytest.mark.parametrize("fmt", ["int4", "int8"])
def test_rows_do_not_depend_on_the_batch(fmt):
    """Bitwise: a row alone (register path), in small tiles, and among 16+ rows (panel path)."""
    w = packing.pack(random_weight(fmt, 328, 576))
    x = bf16_input(70, 576, seed=2)
    full = run(x, w)
    for start, stop in [(0, 1), (5, 6), (3, 5), (3, 9), (0, 5), (4, 13), (64, 70), (1, 17), (1, 66)]:
        assert torch.equal(run(x[start:stop], w), full[start:stop]), (start, stop)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert torch.equal(run(x, w), full)
        assert torch.equal(run(x[:3], w), full[:3])
    finally:
        torch.set_num_threads(threads)


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


@pytest.mark.parametrize("fmt", ["int4", "int8"])
@pytest.mark.parametrize("m", [1, 3, 5, 16, 40, 130])
def test_unpacked_copy_gives_the_same_bits(fmt, m):
    """The once-unpacked weights (QuantLinear keeps them for int8) change the speed, never a bit."""
    w = packing.pack(random_weight(fmt, 328, 576))
    unpacked = ops.bf16_unpack(fmt, w.data, w.n, 576)
    x = bf16_input(m, 576, seed=3)
    assert torch.equal(ops.bf16_quant_linear_unpacked(x, fmt, w.data, unpacked, w.n), run(x, w))
