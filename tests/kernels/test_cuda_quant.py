"""engine/layers/cuda_quant.py: quantized checkpoints' layers on CUDA (tinygemm int4, FP8 on
_scaled_mm). Without a GPU the same layers run on CPU through torch's CPU variants of those
ops (tinygemm's scales and zeros, the same per-token FP8 quantization), which checks the host
side: group detection, the midpoint zeros, act-order, K padding, the scales' shapes. With one,
each check also runs on the device."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from cpu_kernels.fp8_format import Fp8Weight
from cpu_kernels.quant_format import QuantizedTensor
from engine.layers.cuda_quant import (ScaledMmFp8Linear, TinyGemmInt4Linear, prepare_cuda, quantize_per_token,
                                      tinygemm_parts)
from engine.layers.fp8 import Fp8Linear
from engine.layers.quantized import QuantLinear
from test_quant_linear import gptq_like_weight, random_weight

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU"))]


def quant_linear(weight: QuantizedTensor, device: str = "cpu") -> QuantLinear:
    n, k = weight.shape
    layer = QuantLinear(k, n, weight.format).to(device)
    layer.load_rows(QuantizedTensor(weight.format, *(None if t is None else t.to(device) for t in (
        weight.qweight, weight.scales, weight.zeros, weight.perm))), 0)
    return layer


def tinygemm_reference(weight: QuantizedTensor) -> torch.Tensor:
    """The weights tinygemm multiplies: (q - 8) * scale + zero, its bf16 scales and zeros."""
    values, group, parts = tinygemm_parts(weight)
    s, z = (parts[..., i].float().t().repeat_interleave(group, dim=1) for i in (0, 1))
    return (values.float() - 8) * s + z


def test_groups_are_the_widest_the_blocks_share():
    assert tinygemm_parts(gptq_like_weight(16, 512))[1] == 128
    assert tinygemm_parts(random_weight("int4", 16, 512))[1] == 32  # GGUF: a scale per block
    values, _, parts = tinygemm_parts(gptq_like_weight(16, 512))
    assert values.shape == (16, 512) and parts.shape == (4, 16, 2) and parts.dtype == torch.bfloat16


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("act_order", [False, True])
def test_tinygemm_layer_matches_its_weights(device, act_order):
    """Within bf16 rounding of its own weights, and those within a bf16 step of the exact ones."""
    weight = gptq_like_weight(64, 384, seed=1)
    if act_order:
        weight.perm = torch.randperm(384, generator=torch.Generator().manual_seed(0))
    layer = TinyGemmInt4Linear(quant_linear(weight, device))
    x = torch.randn(5, 384, generator=torch.Generator().manual_seed(2)).bfloat16()
    y = layer(x.to(device)).float().cpu()
    ours = tinygemm_reference(weight)
    exact = weight.dequantize()
    if act_order:  # tinygemm holds the columns in the blocks' order; the layer gathers x likewise
        ours = torch.empty_like(ours).index_copy_(1, weight.perm, ours)
    ref = x.double() @ ours.double().t()
    assert ((y - ref).abs() <= ref.abs() * 2**-7 + 2e-3 * ref.abs().max()).all()
    assert ((ours - exact).abs() <= 2**-7 * exact.abs().max()).all()


def fp8_layer(n: int, k: int, device: str) -> tuple[Fp8Linear, Fp8Weight]:
    g = torch.Generator().manual_seed(3)
    data = (torch.randn(n, k, generator=g) * 2).to(torch.float8_e4m3fn)
    weight = Fp8Weight(data, torch.rand(n, generator=g) * 0.01 + 1e-3, "channel")
    layer = Fp8Linear(k, n, bias=True).to(device)
    layer.load_rows(Fp8Weight(weight.data.to(device), weight.scale.to(device), "channel"), 0)
    layer.bias.data = torch.randn(n, generator=g).to(device)
    return layer, weight


@pytest.mark.parametrize("device", DEVICES)
def test_scaled_mm_layer_quantizes_each_token(device):
    """x quantized per token to e4m3 (amax / 448), times the e4m3 weights, both scales applied
    to the fp32 sums: within a bf16 rounding of that product in float64; K = 200 is padded."""
    layer, weight = fp8_layer(48, 200, device)
    fast = ScaledMmFp8Linear(layer)
    x = torch.randn(7, 200, generator=torch.Generator().manual_seed(4)).bfloat16()
    x[3] = 0  # a row of zeros: scale clamped, output the bias alone
    y = fast(x.to(device)).float().cpu()
    q, scale = quantize_per_token(x.float())
    ref = (q.double() * scale.double()) @ weight.dequantize().double().t() + layer.bias.detach().cpu().double()
    assert ((y - ref).abs() <= ref.abs() * 2**-7 + 1e-3 * ref.abs().max()).all()
    assert torch.equal(y[3], layer.bias.detach().cpu().float())
    assert (q.float().abs().amax(-1)[[0, 1, 2, 4, 5, 6]] == 448).all()  # each row's largest maps to e4m3's


def test_prepare_keeps_what_runs_and_densifies_the_rest():
    """int4 (N a multiple of 8) runs on tinygemm; int8 blocks, int4 with N = 12, and (on a CPU,
    without FP8 tensor cores) FP8 become dense layers of the same weights."""
    model = nn.Module()
    model.int4 = quant_linear(gptq_like_weight(16, 256))
    model.int8 = quant_linear(random_weight("int8", 16, 256))
    model.narrow = quant_linear(gptq_like_weight(12, 256))
    model.fp8 = fp8_layer(16, 64, "cpu")[0]
    expected = {name: getattr(model, name).weight.dequantize() for name in ("int8", "narrow", "fp8")}
    prepare_cuda(model, torch.bfloat16)
    assert isinstance(model.int4, TinyGemmInt4Linear)
    for name, weight in expected.items():
        dense = getattr(model, name)
        assert type(dense) is nn.Linear and torch.equal(dense.weight, weight.bfloat16())


def test_a_whole_model_through_the_cuda_branch(tmp_path, monkeypatch, bundled_tokenizer):
    """The loader's CUDA branch (`prepare_cuda`) on a whole GPTQ act-order asymmetric model, run
    on CPU by torch's CPU tinygemm: every int4 layer on it, the model built and served, and
    each prompt's first greedy tokens those of the float model of its weights (tinygemm's bf16
    scales and zeros may move a near tie: all but one prompt)."""
    import random

    from engine.models import loader
    from helpers import build_tiny_model
    from pagedserve import LLM, SamplingParams
    from quant_packing import export
    base = build_tiny_model("llama", tmp_path / "base", bundled_tokenizer)
    export(base, tmp_path / "q", tmp_path / "reference", "gptq-actorder-asym")
    engine = dict(dtype="bfloat16", num_kv_blocks=64, max_model_len=256, num_threads=2)
    params = SamplingParams(temperature=0, max_tokens=3, min_tokens=3)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in (1, 7, 30, 64, 100)]
    ref = [out.outputs[0].token_ids for out in LLM(str(tmp_path / "reference"), **engine).generate(prompts, params)]
    monkeypatch.setattr(loader, "_prepare_quantized", lambda model, dtype, device, amx=False, exact=False, int8=False:
                        prepare_cuda(model, loader.DTYPES[dtype]))
    llm = LLM(str(tmp_path / "q"), **engine)
    layers = [m for m in llm.engine.model_runner.model.modules() if isinstance(m, TinyGemmInt4Linear)]
    assert len(layers) == 4 * llm.engine.model_runner.model.config.num_layers
    assert all(layer.perm is not None for layer in layers[:1])  # qkv gathers its inputs (act-order)
    ours = [out.outputs[0].token_ids for out in llm.generate(prompts, params)]
    assert sum(a == b for a, b in zip(ours, ref)) >= len(prompts) - 1
