"""The int4/int8 quant_linear CPU kernels against their plain-torch reference, the block
formats against gguf-py, and the batch invariance the engine relies on."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import cpu_kernels
from cpu_kernels import ops
from cpu_kernels.quant_format import QuantizedTensor, quantize, reference_linear, unpack_int4

if not cpu_kernels.available("quant_linear"):
    pytest.skip(f"CPU kernels unavailable: {cpu_kernels.unavailable_reason('quant_linear')}",
                allow_module_level=True)

SHAPES = [(1, 64, 32), (3, 96, 576), (4, 33, 64), (5, 576, 1536), (17, 130, 96), (65, 7, 256), (130, 512, 576)]


def random_weight(fmt: str, n: int, k: int, seed: int = 0) -> QuantizedTensor:
    g = torch.Generator().manual_seed(seed)
    scales = torch.rand(n, k // 32, generator=g) * 0.02
    if fmt == "int4":  # fp16 scales and zeros, as GGUF stores them
        q = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=g)
        zeros = -torch.rand(n, k // 32, generator=g) * 0.1
        return QuantizedTensor("int4", q, scales.half().float(), zeros.half().float())
    return QuantizedTensor("int8", torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g), scales)


def gptq_like_weight(n: int, k: int, seed: int = 0) -> QuantizedTensor:
    """int4 groups of 128 as GPTQ/AWQ hold them: fp16 scales s, integer zero points z in 0..15,
    zero = -s * z in float32 (mostly not exact in fp16)."""
    g = torch.Generator().manual_seed(seed)
    groups = k // 128
    scales = (torch.rand(n, groups, generator=g) * 0.02 + 1e-3).half().float()
    z = torch.randint(0, 16, (n, groups), generator=g).float()
    values = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    return QuantizedTensor.from_groups("int4", values, scales, -scales * z)


def run(x: torch.Tensor, w: QuantizedTensor) -> torch.Tensor:
    if w.format == "int4":
        return ops.int4_linear(x, w.qweight, w.scales, w.zeros)
    return ops.int8_linear(x, w.qweight, w.scales)


@pytest.mark.parametrize("fmt", ["int4", "int8"])
@pytest.mark.parametrize("m,n,k", SHAPES)
def test_kernel_matches_reference(fmt, m, n, k):
    w = random_weight(fmt, n, k)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(1)) * 3
    x[0, :32] = 0  # an all-zero block quantizes to zeros, not NaN
    out, ref = run(x, w), reference_linear(x, w)
    assert out.shape == (m, n) and torch.isfinite(out).all()
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())


# Row slices of a 70-row batch that cross every linear kernel's paths: one row (the register
# path), small tiles at every position, 16 rows and more (panels), partial tiles.
ROW_SLICES = [(0, 1), (5, 6), (3, 5), (3, 9), (0, 5), (4, 13), (64, 70), (1, 17), (1, 66), (0, 16), (2, 34)]


def assert_rows_do_not_depend_on_the_batch(linear, x: torch.Tensor) -> None:
    """Bitwise: each slice of ROW_SLICES of `x` gives its rows of the whole batch's output,
    and so do the batch and its first rows at one thread."""
    full = linear(x)
    for start, stop in ROW_SLICES:
        assert torch.equal(linear(x[start:stop]), full[start:stop]), (start, stop)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert torch.equal(linear(x), full)
        assert torch.equal(linear(x[:3]), full[:3])
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("fmt", ["int4", "int8"])
def test_rows_do_not_depend_on_the_batch(fmt):
    """Bitwise: a row alone, at every position in tiles of 4, and with any neighbours."""
    w = random_weight(fmt, 200, 576)
    x = torch.randn(70, 576, generator=torch.Generator().manual_seed(2))
    assert_rows_do_not_depend_on_the_batch(lambda rows: run(rows, w), x)


@pytest.mark.parametrize("fmt", ["int4", "int8"])
def test_quantize_round_trip(fmt):
    weight = torch.randn(64, 128, generator=torch.Generator().manual_seed(3))
    weight[1, :32] = 0.5  # a constant block: step 0
    q = quantize(weight, fmt)
    error = (q.dequantize() - weight).abs().view(64, 4, 32)
    assert (error <= q.scales[..., None] / 2 + 1e-6).all()
    assert torch.equal(q.dequantize()[1, :32], weight[1, :32])


def test_int4_packing_is_ggufs():
    """Byte j of a block: value j in the low nibble, value j + 16 in the high one."""
    values = torch.arange(32, dtype=torch.uint8).remainder(16).view(1, 32)
    packed = torch.tensor([[j % 16 | ((j + 16) % 16) << 4 for j in range(16)]], dtype=torch.uint8)
    assert torch.equal(unpack_int4(packed), values)


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0"])
def test_gguf_blocks_dequantize_as_gguf_py(kind):
    gguf = pytest.importorskip("gguf")
    from gguf.quants import dequantize, quantize as gguf_quantize

    from engine.models.gguf_loader import _blocks
    weight = np.random.default_rng(4).standard_normal((48, 96)).astype(np.float32)
    kind_id = gguf.GGMLQuantizationType[kind]
    raw = gguf_quantize(weight, kind_id)
    expected = torch.from_numpy(np.array(dequantize(raw, kind_id), dtype=np.float32))
    assert torch.equal(_blocks(raw, kind).dequantize(), expected)


def test_launcher_rejects_bad_shapes():
    w = random_weight("int4", 8, 64)
    with pytest.raises(ValueError, match="float32"):
        ops.int4_linear(torch.zeros(2, 64, dtype=torch.bfloat16), w.qweight, w.scales, w.zeros)
    with pytest.raises(ValueError, match="multiple of 32"):
        ops.int4_linear(torch.zeros(2, 48), w.qweight, w.scales, w.zeros)
