"""The fused layer ops (cpu_kernels/csrc/layer_ops.cpp) against the eager torch code they
replace, which stays in the layers (`kernels` None): RMSNorm with and without the
residual add, rotary in place on a strided view of the fused qkv, SiLU-and-mul.

float32: equal up to the last bits of a reduction order or an exp. bfloat16: the ops round
where eager rounds, so results are bitwise equal but for rare one-ulp ties."""

from __future__ import annotations

import pytest
import torch

import cpu_kernels
from cpu_kernels import ops
from engine.layers.activation import ClampedSwiGLU, SiluAndMul
from engine.layers.norm import RMSNorm
from engine.layers.rotary import RotaryEmbedding
from layer_checks import assert_matches_eager, pair, randn

if not cpu_kernels.available("layer_ops"):
    pytest.skip(f"CPU kernels unavailable: {cpu_kernels.unavailable_reason('layer_ops')}", allow_module_level=True)

DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,hidden", [(1, 576), (7, 64), (40, 100)])
def test_rms_norm(dtype, rows, hidden):
    norm = RMSNorm(hidden, 1e-5).to(dtype)
    norm.weight.data = randn(hidden, dtype=dtype, seed=1)
    x = randn(rows, hidden, dtype=dtype) * 4
    fused, eager = pair(norm, ops, x)
    assert_matches_eager(fused, eager)
    (fused, fused_res), (eager, eager_res) = pair(norm, ops, x, randn(rows, hidden, dtype=dtype, seed=2))
    assert torch.equal(fused_res, eager_res)  # the add rounds once, in both
    assert_matches_eager(fused, eager)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_in_place_on_a_strided_view(dtype):
    """q and k heads of a fused [T, (Hq + 2 Hkv) * D] row, rotated in place; v untouched."""
    head_dim, hq, hkv, rows = 64, 9, 3, 11
    rotary = RotaryEmbedding(head_dim, 4096, 10000.0, None)
    qkv = randn(rows, (hq + 2 * hkv) * head_dim, dtype=dtype)
    positions = torch.tensor([0, 1, 5, 17, 100, 4095, 3, 3, 2000, 64, 1])
    results = []
    for kernels in (ops, None):
        rotary.kernels = kernels
        heads = qkv.clone().view(rows, -1, head_dim)
        qk = heads[:, :hq + hkv]
        results.append((rotary(positions, dtype).rotate(qk).clone(), heads[:, hq + hkv:].clone()))
    (fused, v_after), (eager, _) = results
    assert torch.equal(v_after, qkv.view(rows, -1, head_dim)[:, hq + hkv:])
    assert torch.equal(fused, eager)  # the same roundings in the same order


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul(dtype):
    x = randn(9, 2 * 1536, dtype=dtype) * 6
    x[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])  # exp's far ends
    fused, eager = pair(SiluAndMul(), ops, x)
    assert_matches_eager(fused, eager)


@pytest.mark.parametrize("dtype", DTYPES)
def test_clamped_swiglu(dtype):
    """gpt-oss's activation (alpha 1.702, limit 7): both clamps bite (|x| up to 24), exp's far
    ends, NaN kept as torch.clamp keeps it."""
    x = randn(9, 2 * 1440, dtype=dtype) * 6
    x[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])
    x[1, 1440:1444] = torch.tensor([-100.0, 100.0, 6.99, -7.5])
    fused, eager = pair(ClampedSwiGLU(1.702, 7.0), ops, x)
    assert_matches_eager(fused, eager)
    x[2, 3] = float("nan")
    fused, eager = pair(ClampedSwiGLU(1.702, 7.0), ops, x)
    assert torch.isnan(fused[2, 3]) and torch.isnan(eager[2, 3])


def test_ops_reject_bad_inputs():
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        ops.rms_norm(torch.zeros(2, 8, dtype=torch.float16), torch.ones(8, dtype=torch.float16), 1e-5)
    with pytest.raises(RuntimeError, match="outside the table"):
        ops.rotary(torch.zeros(1, 64), torch.tensor([10]), torch.zeros(4, 64), torch.zeros(4, 64), 1, 64)


@pytest.mark.parametrize("vocab", [49152, 1000, 33])
def test_apply_token_bitmask_matches_the_torch_reference(vocab):
    from engine.sampler import apply_token_bitmask
    torch.manual_seed(vocab)
    logits = torch.randn(6, vocab)
    bitmask = torch.randint(-2**31, 2**31 - 1, (3, (vocab + 31) // 32), dtype=torch.int32)
    bitmask[0] = -1  # everything allowed
    bitmask[1, 1:] = 0  # only the first word's tokens
    rows = torch.tensor([4, 0, 2])
    ours, ref = logits.clone(), logits.clone()
    ops.apply_token_bitmask(ours, bitmask, rows)
    apply_token_bitmask(ref, bitmask, rows)
    assert torch.equal(ours, ref)
    assert torch.equal(ours[[1, 3, 5]], logits[[1, 3, 5]])  # rows without a mask are untouched
    allowed = [t for t in range(vocab) if (int(bitmask[2, t // 32]) >> (t % 32)) & 1]
    assert torch.isfinite(ours[2]).nonzero().flatten().tolist() == allowed
