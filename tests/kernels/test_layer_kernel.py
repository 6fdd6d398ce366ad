"""The CUDA layer ops (cupy_kernels/csrc/layers.cu) against the eager torch code they replace,
on the same GPU: RMSNorm with and without the residual add, rotary in place on a strided
view of the fused qkv, SiLU-and-mul. The engine with them (its default on CUDA) and without
(`layer_kernels=False`) against HF: tests/kernels/test_gpu_e2e.py.

float32: equal up to the last bits of a reduction order, an exp or a fused multiply-add.
16-bit: the kernels round where eager rounds, so results are equal but for rare ties, where an
ulp's difference inside (a reduction order) can grow by the weight it is multiplied with:
on an H100 (2026-11-27) one float16 RMSNorm output in 229,376 was 2 ulps apart."""

from __future__ import annotations

import pytest
import torch

from gpu_skip import pytestmark  # noqa: F401  (skips this module without a GPU)
from cupy_kernels import ops
from engine.layers.activation import SiluAndMul
from engine.layers.norm import RMSNorm
from engine.layers.rotary import RotaryEmbedding
import layer_checks
from layer_checks import pair

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def assert_matches_eager(out: torch.Tensor, ref: torch.Tensor) -> None:
    # A few ulps where they differ: an ulp of R(x * r) times a weight up to ~3.
    layer_checks.assert_matches_eager(out, ref, max_ulps=4)


def randn(*shape, dtype=torch.float32, seed=0):
    return layer_checks.randn(*shape, dtype=dtype, seed=seed, device="cuda")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,hidden", [(1, 576), (7, 64), (40, 100), (256, 896), (3, 4096)])
def test_rms_norm(dtype, rows, hidden):
    norm = RMSNorm(hidden, 1e-5).to("cuda", dtype)
    norm.weight.data = randn(hidden, dtype=dtype, seed=1)
    x = randn(rows, hidden, dtype=dtype) * 4
    fused, eager = pair(norm, ops, x)
    assert_matches_eager(fused, eager)
    (fused, fused_res), (eager, eager_res) = pair(norm, ops, x, randn(rows, hidden, dtype=dtype, seed=2))
    assert torch.equal(fused_res, eager_res)  # the add rounds once, in both
    assert_matches_eager(fused, eager)


def test_rms_norm_of_strided_rows():
    """A view's rows (q_norm over heads of a fused projection): only the view's elements are read."""
    norm = RMSNorm(64, 1e-6).to("cuda")
    wide = randn(5, 3 * 64)
    fused = ops.rms_norm(wide[:, 64:128], norm.weight, 1e-6)
    assert_matches_eager(fused, norm(wide[:, 64:128].contiguous()))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_rotary_in_place_on_a_strided_view(dtype, head_dim):
    """q and k heads of a fused [T, (Hq + 2 Hkv) * D] row, rotated in place; v untouched."""
    hq, hkv, rows = 9, 3, 11
    rotary = RotaryEmbedding(head_dim, 4096, 10000.0, None)
    rotary.build("cuda")
    qkv = randn(rows, (hq + 2 * hkv) * head_dim, dtype=dtype)
    positions = torch.tensor([0, 1, 5, 17, 100, 4095, 3, 3, 2000, 64, 1], device="cuda")
    results = []
    for kernels in (ops, None):
        rotary.kernels = kernels
        heads = qkv.clone().view(rows, -1, head_dim)
        qk = heads[:, :hq + hkv]
        results.append((rotary(positions, dtype).rotate(qk).clone(), heads[:, hq + hkv:].clone()))
    (fused, v_after), (eager, _) = results
    assert torch.equal(v_after, qkv.view(rows, -1, head_dim)[:, hq + hkv:])
    assert_matches_eager(fused, eager)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inter", [1536, 4864, 100])
def test_silu_and_mul(dtype, inter):
    x = randn(9, 2 * inter, dtype=dtype) * 6
    x[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])  # exp's far ends
    fused, eager = pair(SiluAndMul(), ops, x)
    assert_matches_eager(fused, eager)


def test_no_rows_launch_nothing():
    x = torch.empty(0, 64, device="cuda")
    assert ops.rms_norm(x, torch.ones(64, device="cuda"), 1e-5).shape == (0, 64)
    assert ops.silu_and_mul(torch.empty(0, 128, device="cuda")).shape == (0, 64)
