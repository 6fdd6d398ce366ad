"""The integer MXFP4 kernel (cpu_kernels/csrc/mxfp4_int8.cpp, --cpu-arithmetic int8) against
its reference (mxfp4_format.int8_linear_reference: the activations rounded to 8 bits per
block of 32, times the weights' exact values, in float64): within the bf16 output's rounding,
over every e2m1 code and e8m0 scale; the same bits for a row alone, in any batch and at any
thread count; its packed layout (mxfp4_format.pack_int8) read back byte by byte. The module
skips where the kernel cannot run (no AVX512-VNNI, or no compiler)."""

from __future__ import annotations

import pytest
import torch

from cpu_kernels import mxfp4_format, ops
from cpu_kernels.quant_format import from_mxfp4, to_mxfp4
from test_quant_linear import assert_rows_do_not_depend_on_the_batch

if not ops.int8_dot_supported():
    pytest.skip("the integer MXFP4 kernel needs AVX512-VNNI (or the kernels are unavailable)", allow_module_level=True)

# (M, N, K): one group, a partial last group (N off 16), odd group counts, rows around the
# 4-row tiles, and gpt-oss-20b's expert width.
SHAPES = [(1, 16, 32), (2, 40, 64), (3, 33, 96), (4, 48, 128), (5, 200, 576), (9, 17, 32), (1, 2880, 2880)]


def random_mxfp4(n: int, k: int, seed: int = 0, exponents: tuple[int, int] = (119, 124)):
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (n, k // 32, 16), dtype=torch.uint8, generator=g)
    scales = torch.randint(exponents[0], exponents[1] + 1, (n, k // 32), dtype=torch.uint8, generator=g)
    return blocks, scales


def assert_matches_reference(x: torch.Tensor, blocks: torch.Tensor, scales: torch.Tensor) -> None:
    """The kernel's bf16 output within one bf16 rounding (plus float32 summation noise) of the
    float64 reference."""
    y = ops.mxfp4_int8_linear(x, mxfp4_format.pack_int8(blocks, scales), blocks.shape[0])
    ref = mxfp4_format.int8_linear_reference(x, blocks, scales)
    assert y.dtype == torch.bfloat16 and y.shape == ref.shape
    tol = ref.abs() * 2.0**-8 + ref.abs().max() * 1e-6
    assert ((y.double() - ref).abs() <= tol).all(), (y.double() - ref).abs().max()


@pytest.mark.parametrize("m,n,k", SHAPES)
def test_matches_reference(m, n, k):
    blocks, scales = random_mxfp4(n, k, seed=n + k)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).bfloat16()
    assert_matches_reference(x, blocks, scales)


def test_scales_and_extreme_activations():
    """e8m0 scales over 2^-40..2^20, negative zero codes, a block of zero activations (d = 0)
    and a block whose one large value rounds the rest to 0."""
    n, k = 32, 256
    blocks, scales = random_mxfp4(n, k, seed=5, exponents=(127 - 40, 127 + 20))
    blocks[0] = 0x88  # every value of row 0 a negative zero
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(6))
    x[1, :32] = 0
    x[2, 32:64] = 1e-6
    x[2, 40] = 1e4
    assert_matches_reference(x.bfloat16(), blocks, scales)


def test_rows_do_not_depend_on_the_batch():
    blocks, scales = random_mxfp4(72, 576, seed=1)
    packed = mxfp4_format.pack_int8(blocks, scales)
    x = torch.randn(70, 576, generator=torch.Generator().manual_seed(2)).bfloat16()
    assert_rows_do_not_depend_on_the_batch(lambda rows: ops.mxfp4_int8_linear(rows.contiguous(), packed, 72), x)


def test_layout():
    """Each code lands where the kernel's header says: chunk h of block b of group g, byte
    4c + t, low nibble for k = 32b + 8h + t, high nibble for k + 4; then 16 e8m0 bytes."""
    n, k = 20, 64
    blocks, scales = random_mxfp4(n, k, seed=3)
    codes = torch.stack([blocks & 15, blocks >> 4], dim=-1).reshape(n, k)
    packed = mxfp4_format.pack_int8(blocks, scales)
    groups, nblocks = 2, k // 32
    nibbles = packed[:groups * nblocks * 256].view(groups, nblocks, 4, 16, 4)
    e8m0 = packed[groups * nblocks * 256:].view(groups, nblocks, 16)
    assert packed.numel() == groups * nblocks * 272
    for col in range(groups * 16):
        g, c = divmod(col, 16)
        for kk in range(k):
            b, h, half, t = kk // 32, kk % 32 // 8, kk % 8 // 4, kk % 4
            byte = int(nibbles[g, b, h, c, t])
            want = int(codes[col, kk]) if col < n else 0
            assert (byte >> 4 * half) & 15 == want, (col, kk)
        for b in range(nblocks):
            assert int(e8m0[g, b, c]) == (int(scales[col, b]) if col < n else 0)


def test_to_mxfp4_inverts_from_mxfp4():
    blocks, scales = random_mxfp4(24, 96, seed=4, exponents=(1, 254))
    back = to_mxfp4(from_mxfp4(blocks, scales))
    assert torch.equal(back[0], blocks) and torch.equal(back[1], scales)


def test_bad_packed_weights_are_refused():
    blocks, scales = random_mxfp4(16, 64)
    packed = mxfp4_format.pack_int8(blocks, scales)
    x = torch.randn(1, 64).bfloat16()
    with pytest.raises(RuntimeError, match="packed MXFP4 weights"):
        ops.mxfp4_int8_linear(x, packed[:-1].contiguous(), 16)
    with pytest.raises(RuntimeError, match="bfloat16"):
        ops.mxfp4_int8_linear(x.float(), packed, 16)
