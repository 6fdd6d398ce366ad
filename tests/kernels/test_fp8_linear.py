"""The FP8 linear kernel (cpu_kernels/csrc/fp8_linear.cpp) against its reference, x times the
dequantized float32 weights fp8.float() * scale (cpu_kernels.reference.fp8_linear), with
per-tensor, per-channel and 128 x 128 block scales; the widening of every e4m3fn byte; its
packed layout (cpu_kernels/fp8_format.py) against the row layout; and batch invariance across
the register path (few rows), the panel path (16 rows and more) and thread counts. Each test
runs in every arithmetic this CPU has: float32 activations (fma), bfloat16 (VDPBF16PS) and
AMX (skips without AMX tiles, as the int kernels' AMX tests do). The module skips where the
kernel cannot run (no AVX-512 VBMI, or no compiler)."""

from __future__ import annotations

import pytest
import torch

from cpu_kernels import fp8_format, ops, reference
from cpu_kernels.fp8_format import Fp8Weight
from test_quant_linear import assert_rows_do_not_depend_on_the_batch

if not ops.fp8_supported():
    pytest.skip("the FP8 kernel needs AVX-512 F/BW/VBMI (or the kernels are unavailable)", allow_module_level=True)

needs_bf16 = pytest.mark.skipif(not ops.fp8_bf16_supported(), reason="no AVX512-BF16 on this CPU")
needs_amx = pytest.mark.skipif(not ops.fp8_amx_ready(), reason="no AMX tiles on this CPU, or no permission")
ARITHMETICS = [pytest.param("float32"), pytest.param("vdpbf16", marks=needs_bf16),
               pytest.param("amx", marks=needs_amx)]
NAN_BYTES = (0x7F, 0xFF)

# (M, N, K). Per-tensor and per-channel: N and K off multiples of 16, 32 and 128 (K is padded to
# 32 inside); one group; narrow last super-groups; 15/16/17 rows around the panel path.
SHAPES = [(1, 16, 32), (1, 600, 576), (2, 20, 8), (2, 130, 96), (3, 96, 200), (5, 300, 256), (15, 200, 64), (16, 200, 100),
          (17, 130, 96), (40, 328, 576), (64, 140, 260)]
# Blocks of 128 x 128: N and K multiples of 128 or not (a partial last block, as DeepSeek's
# ceil(N / 128) x ceil(K / 128) scales allow).
BLOCK_SHAPES = [(1, 256, 256), (1, 600, 640), (3, 130, 384), (4, 136, 200), (5, 200, 128), (16, 200, 128),
                (33, 384, 512), (64, 136, 640)]


def random_fp8(n: int, k: int, kind: str, seed: int = 0) -> Fp8Weight:
    """Every e4m3fn byte but NaN, shuffled (each appears once in every 254 weights), and
    scales as checkpoints hold them (small, positive)."""
    g = torch.Generator().manual_seed(seed)
    values = torch.tensor([b for b in range(256) if b not in NAN_BYTES], dtype=torch.uint8)
    data = values[torch.randperm(n * k, generator=g) % len(values)].view(n, k)
    shape = {"tensor": (1,), "channel": (n,), "block": (-(-n // 128), -(-k // 128))}[kind]
    return Fp8Weight(data, torch.rand(shape, generator=g) * 0.01 + 1e-3, kind)


def random_x(m: int, k: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(m, k, generator=torch.Generator().manual_seed(seed)) * 3


def run(x: torch.Tensor, packed: fp8_format.PackedFp8, arithmetic: str) -> torch.Tensor:
    """float32 output: the kernel's fp32 sums, unrounded."""
    if arithmetic == "float32":
        return ops.fp8_linear(x.float().contiguous(), packed)
    return ops.fp8_linear(x.bfloat16().contiguous(), packed, amx=arithmetic == "amx", out_dtype=torch.float32)


def activations(x: torch.Tensor, arithmetic: str) -> torch.Tensor:
    """x as the arithmetic takes it (bf16-rounded unless float32)."""
    return x if arithmetic == "float32" else x.bfloat16().float()


def assert_matches_reference(x: torch.Tensor, w: Fp8Weight, arithmetic: str) -> torch.Tensor:
    """Within fp32 summation error of x @ (fp8 * scale)^T: |out - ref| <= 1e-5 (|x| @ |w|^T)
    per element (both sum in float32, in different orders; a sum of K terms rounds by at most
    about K 2^-24 of that bound, and in practice by 1e-7 to 1e-6)."""
    xs = activations(x, arithmetic)
    out = run(x, fp8_format.pack(w), arithmetic)
    ref = reference.fp8_linear(xs, w)
    bound = 1e-5 * (xs.abs() @ w.dequantize().abs().t())
    assert out.shape == ref.shape and torch.isfinite(out).all()
    assert ((out - ref).abs() <= bound).all(), ((out - ref).abs() / bound).max()
    return out


@pytest.mark.parametrize("arithmetic", ARITHMETICS)
@pytest.mark.parametrize("kind", ["tensor", "channel"])
@pytest.mark.parametrize("m,n,k", SHAPES)
def test_kernel_matches_reference(m, n, k, kind, arithmetic):
    x = random_x(m, k)
    x[0, :32] = 0
    assert_matches_reference(x, random_fp8(n, k, kind), arithmetic)


@pytest.mark.parametrize("arithmetic", ARITHMETICS)
@pytest.mark.parametrize("m,n,k", BLOCK_SHAPES)
def test_block_scales_match_reference(m, n, k, arithmetic):
    """Each 128 x 128 block's scale applies to its own k block (sum over blocks of scale x dot)."""
    assert_matches_reference(random_x(m, k), random_fp8(n, k, "block"), arithmetic)


@pytest.mark.parametrize("arithmetic", ARITHMETICS)
@pytest.mark.parametrize("m", [1, 5, 32])
def test_every_byte_widens_to_its_value(m, arithmetic):
    """One-hot rows of x (m at a time) read single weights back: each of the 254 non-NaN
    bytes gives exactly torch's float8_e4m3fn value (subnormals, both zeros, +-448). A row
    holding NaN bytes gives NaN, as the reference does (0 x NaN), and does not crash."""
    values = torch.tensor([b for b in range(256) if b not in NAN_BYTES] + [0, 0], dtype=torch.uint8)
    nan_row = torch.zeros(1, 32, dtype=torch.uint8)
    nan_row[0, 3], nan_row[0, 20] = NAN_BYTES
    w = Fp8Weight(torch.cat([values.view(8, 32), nan_row]), torch.ones(1), "tensor")
    packed, x = fp8_format.pack(w), torch.eye(32)
    out = torch.cat([run(x[i:i + m], packed, arithmetic) for i in range(0, 32, m)])
    assert out[:, 8].isnan().all() and not out[:, :8].isnan().any()
    assert torch.equal(out[:, :8], w.dequantize()[:8].t())


@pytest.mark.parametrize("arithmetic", ARITHMETICS)
@pytest.mark.parametrize("kind,k", [("block", 640), ("channel", 200)])
def test_rows_do_not_depend_on_the_batch(kind, k, arithmetic):
    """Bitwise: a row alone (register path), in small tiles, among 16+ rows (panel path; AMX:
    tiles from 2 rows, padded rows), and at one thread."""
    w = fp8_format.pack(random_fp8(328, k, kind))
    x = random_x(70, k, seed=2)
    assert_rows_do_not_depend_on_the_batch(lambda rows: run(rows, w, arithmetic), x)


@needs_bf16
@pytest.mark.parametrize("m", [1, 20])
def test_bfloat16_output_is_the_fp32_sums_rounded(m):
    w = fp8_format.pack(random_fp8(200, 256, "block"))
    x = random_x(m, 256).bfloat16()
    out = ops.fp8_linear(x, w)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, ops.fp8_linear(x, w, out_dtype=torch.float32).bfloat16())


@pytest.mark.parametrize("kind,n,k", [("tensor", 16, 32), ("channel", 130, 200), ("channel", 600, 576),
                                      ("block", 200, 384), ("block", 136, 200)])
def test_pack_round_trips(kind, n, k):
    w = random_fp8(n, k, kind)
    packed = fp8_format.pack(w)
    assert packed.data.numel() == -(-n // 16) * 16 * -(-k // 32) * 32  # one byte a weight, padded
    back = fp8_format.unpack(packed)
    assert back.kind == kind and torch.equal(back.data, w.data)
    assert torch.equal(back.scale.flatten(), w.scale.flatten())
    assert torch.equal(back.dequantize(), w.dequantize())


def test_checkpoint_scale_shapes():
    """compressed-tensors' [N, 1] channel scales and float8 tensors are taken as they come;
    a scale that does not fit the weight is refused, naming the shape it wants."""
    data = torch.randn(64, 256).to(torch.float8_e4m3fn)
    w = Fp8Weight(data, torch.rand(64, 1), "channel")
    assert w.data.dtype == torch.uint8 and torch.equal(w.dequantize(), data.float() * w.scale)
    with pytest.raises(ValueError, match=r"want float32 with shape \[1, 2\]"):
        Fp8Weight(data, torch.rand(2, 1), "block")
    with pytest.raises(ValueError, match="scale kind"):
        Fp8Weight(data, torch.rand(1), "group")


def test_op_rejects_bad_inputs():
    packed = fp8_format.pack(random_fp8(32, 64, "channel"))
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        ops.fp8_linear(torch.zeros(2, 64, dtype=torch.float16), packed)
    wrong = fp8_format.PackedFp8(packed.data, packed.scales, 48, 64, packed.k_block, "channel", (128, 128))
    with pytest.raises(RuntimeError, match="packed weights"):
        ops.fp8_linear(torch.zeros(2, 64), wrong)
    with pytest.raises(RuntimeError, match="AMX arithmetic takes bfloat16"):
        ops.fp8_linear(torch.zeros(2, 64), packed, amx=True)
    if not ops.fp8_amx_ready():
        with pytest.raises(RuntimeError, match="AMX"):
            ops.fp8_linear(torch.zeros(2, 64, dtype=torch.bfloat16), packed, amx=True)
