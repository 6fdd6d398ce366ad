"""The AVX2 integer kernels (cpu_kernels/csrc/int_dot_avx2.cpp) bitwise against the AVX512-VNNI
ones (csrc/int_dot.cpp, where this CPU runs them) and the plain-torch reference
(int_dot_format.reference), over test_int_dot.py's grid of shapes and kinds of weight: the same
packed weights, the same bits on every kernel of a machine. Also the same bits for a row alone, in
any batch and at 1 or 2 threads; the sums at the edges of int16 (VPMADDUBSW saturates); the
AVX-VNNI variant where the CPU has it. Skips where the AVX2 kernels cannot run.

The grid, the weights and the activations are test_int_dot.py's (which runs wherever this module
does: it tests whichever kernel `ops.int_dot_linear` takes)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from cpu_kernels import int_dot_format, ops
from cpu_kernels.int_dot_format import PackedIntDot
from cpu_kernels.quant_format import QuantizedTensor
from test_int_dot import COLUMNS, KINDS, ROWS, activations, random_weight
from test_quant_linear import assert_rows_do_not_depend_on_the_batch

if not ops.int_dot_avx2_supported():
    pytest.skip("the AVX2 integer kernels need AVX2 and F16C (or the kernels are unavailable)",
                allow_module_level=True)

def run(x: torch.Tensor, packed: PackedIntDot, vnni: bool = False) -> torch.Tensor:
    return ops.int_dot_avx2_linear(x, packed, vnni)


def assert_same_bits_everywhere(x: torch.Tensor, w: QuantizedTensor, vnni: bool = False) -> torch.Tensor:
    """The AVX2 kernel's output equals the reference's, the AVX512 kernel's and (packed in fp32) its own."""
    packed = int_dot_format.pack(w)
    y = run(x, packed, vnni)
    assert y.dtype == x.dtype and y.shape == (x.shape[0], w.shape[0])
    assert torch.equal(y, int_dot_format.reference(x, w))
    assert torch.equal(run(x, int_dot_format.pack(w, "fp32"), vnni), y)
    if ops.int_dot_kernel() == "avx512_vnni":
        assert torch.equal(ops.int_dot_avx512_linear(x, packed), y)
    return y


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n,k", COLUMNS)
@pytest.mark.parametrize("m", ROWS)
def test_bitwise_equal_to_avx512_and_reference(m, n, k, dtype):
    """float32 x gives the float32 sums themselves: every rounding of the float part checked."""
    for kind, encoding in KINDS:
        w = random_weight(n, k, kind, seed=n + k)
        assert int_dot_format.pack(w).encoding == encoding
        assert_same_bits_everywhere(activations(m, k, seed=m, dtype=dtype), w)


@pytest.mark.parametrize("fmt", ["int4", "int8"])
def test_sums_at_the_edges_of_int16_are_exact(fmt):
    """Every |a| = 127. int4: q = 15 everywhere, a block's int16 pairs summed to 8 x 3810;
    int8: q = -128 and 127 (|q| x a pairs up to 2 x 128 x 127), where q + 128 would saturate."""
    n, k = 48, 256
    g = torch.Generator().manual_seed(11)
    signs = torch.randint(0, 2, (5, k), generator=g) * 2 - 1
    x = (signs * 0.75).float()
    x[0] = 0.75  # every product of a row the same sign: the largest sums
    if fmt == "int4":
        q = torch.full((n, k // 2), 0xFF, dtype=torch.uint8)
        q[n // 2:] = torch.randint(0, 256, (n - n // 2, k // 2), dtype=torch.uint8, generator=g)
        scales = torch.full((n, k // 32), 2.0**-10)
        w = QuantizedTensor("int4", q, scales, -8 * scales)
    else:
        q = torch.full((n, k), -128, dtype=torch.int8)
        q[1::3] = 127
        q[2::3] = torch.tensor([-128, 127], dtype=torch.int8)[torch.randint(0, 2, (n // 3, k), generator=g)]
        w = QuantizedTensor("int8", q, torch.full((n, k // 32), 2.0**-10), None)
    for dtype in (torch.float32, torch.bfloat16):
        assert_same_bits_everywhere(x.to(dtype), w)


@pytest.mark.parametrize("fmt", ["q4_1", "q8_0"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rows_do_not_depend_on_the_batch(dtype, fmt):
    """A row alone, at every position in tiles of 4, with any neighbours, at 1 and 2 threads."""
    packed = int_dot_format.pack(random_weight(200, 576, fmt, seed=1))
    x = torch.randn(70, 576, generator=torch.Generator().manual_seed(2)).to(dtype)
    assert_rows_do_not_depend_on_the_batch(lambda rows: run(rows.contiguous(), packed), x)


@pytest.mark.parametrize("fmt", ["q4_1", "q8_0"])
def test_threads_do_not_change_the_bits(fmt):
    packed = int_dot_format.pack(random_weight(1000, 576, fmt, seed=3))
    x = torch.randn(33, 576, generator=torch.Generator().manual_seed(4))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        two = run(x, packed)
        torch.set_num_threads(1)
        one = run(x, packed)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)


@pytest.mark.skipif(not ops.int_dot_avxvnni_supported(), reason="this CPU lacks AVX-VNNI")
@pytest.mark.parametrize("kind", [kind for kind, _ in KINDS])
def test_avxvnni_same_bits(kind):
    for m, (n, k) in zip([1, 7, 33], [(40, 64), (200, 576), (17, 1536)]):
        x = activations(m, k, seed=m)
        w = random_weight(n, k, kind, seed=n + k)
        assert torch.equal(assert_same_bits_everywhere(x, w, vnni=True), run(x, int_dot_format.pack(w)))


@pytest.mark.skipif(ops.int_dot_avxvnni_supported(), reason="this CPU has AVX-VNNI")
def test_avxvnni_refused_without_it():
    packed = int_dot_format.pack(random_weight(16, 64, "q4_1"))
    with pytest.raises(RuntimeError, match="AVX-VNNI"):
        run(torch.randn(1, 64), packed, vnni=True)


def test_bad_inputs_are_refused():
    packed = int_dot_format.pack(random_weight(16, 64, "q4_1"))
    x = torch.randn(1, 64).bfloat16()
    with pytest.raises(RuntimeError, match="packed weights"):
        run(x, dataclasses.replace(packed, data=packed.data[:-1].contiguous()))
    with pytest.raises(RuntimeError, match="packed weights"):
        run(x, dataclasses.replace(packed, encoding="fp32"))
    with pytest.raises(RuntimeError, match="bfloat16 or float32"):
        run(x.half(), packed)
    with pytest.raises(RuntimeError, match="encoding"):
        run(x, dataclasses.replace(int_dot_format.pack(random_weight(16, 64, "q8_0")), encoding="units"))
