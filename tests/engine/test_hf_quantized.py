"""Quantized HF checkpoints (GPTQ, AWQ, compressed-tensors, block FP8) loaded as stored
(engine/models/hf_quant.py, hf_quant_weights.py).

First each layout's reader against tensors packed by hand from the published definitions
(quant_packing.py): the blocks' effective weights equal the format's dequantization exactly,
and the packing orders are pinned by hand-written words. Then tiny Llama and Qwen3
checkpoints in each layout against a float32 model of their dequantized weights, under
batching, chunked prefill and prefix caching: greedy tokens identical, logprobs within
LOGPROB_ATOL (the only difference is the order of float32 sums: the kernels sum per block of
32). Then act-order in the bf16 kernels, W8A8's int8 activations, tensor parallelism, and the
checkpoints of the real quantizers (tests/quant_checkpoints.py) where that module is present."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from torch import nn

import cpu_kernels
from cpu_kernels import ops
from cpu_kernels.fp8_format import Fp8Weight
from cpu_kernels.quant_format import QuantizedTensor
from engine.layers.fp8 import Fp8Linear
from engine.layers.quantized import QuantLinear
from engine.models.hf_quant import check_tensors, parse_quant_config
from engine.models.hf_quant_weights import read_weight
from engine.models.loader import iter_weights, linear_formats, read_arch_config, weight_format
from pagedserve import LLM, SamplingParams
from helpers import build_tiny_model, check_outputs_match, greedy_with_logprobs, logprob_gaps
from quant_packing import KINDS, export, pack_awq, pack_int32, quantize_groups, quantize_layer
from test_tiny_hf_equivalence import tiny_prompts

pytestmark = pytest.mark.heavy(80)  # seconds on the 2-core CI machine: scheduled first
needs_kernels = pytest.mark.skipif(not cpu_kernels.available("quant_linear"),
                                   reason=f"CPU kernels unavailable: {cpu_kernels.unavailable_reason('quant_linear')}")
LOGPROB_ATOL = 1e-4  # float32 logprobs of the same weights, summed in another order (seen: 6e-6)
# W8A8: a float32 difference upstream can move an activation across a rounding boundary of its
# int8 grid, one step of its scale; seen: 0.035. A near-tie may then flip one greedy token.
W8A8_LOGPROB_ATOL = 0.1
MAX_NEW = 12
FP8_KINDS = ("ct-fp8", "fp8-block")
# FP8 runs as stored where its kernel does (float32 models; bfloat16 ones need AVX512-BF16 too).
fp8_kernel = ops.fp8_supported()
STRESS = dict(num_kv_blocks=24, max_num_batched_tokens=40, enable_prefix_caching=True)
DIMS = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4}


def parse(config: dict):
    return parse_quant_config({"quantization_config": config, **DIMS})


# -- Readers ---------------------------------------------------------------------------

def test_packing_orders_pinned_by_hand():
    """Value j of a GPTQ / compressed-tensors int32 sits at bits 4j; AWQ's nibble i holds column
    [0, 2, 4, 6, 1, 3, 5, 7][i]. The words are written out, not computed."""
    assert pack_int32(torch.tensor([[1, 2, 3, 4, 5, 6, 7, 0]]), 4, 1).item() == 0x07654321
    assert pack_awq(torch.tensor([[1, 2, 3, 4, 5, 6, 7, 0]])).item() == 0x06427531
    gptq = parse({"quant_method": "gptq", "bits": 4, "group_size": -1, "checkpoint_format": "gptq_v2"})
    word = torch.tensor([[0x07654321] * 4] * 32, dtype=torch.int32)  # qweight [K/8, N]: K = 256, N = 4
    weight = read_weight(gptq, gptq.schemes[0].weights, {"qweight": word, "qzeros": torch.zeros(1, 1, dtype=torch.int32),
                                                         "scales": torch.ones(1, 4, dtype=torch.float16)})
    assert weight.dequantize()[0, :8].tolist() == [1, 2, 3, 4, 5, 6, 7, 0]
    awq = parse({"quant_method": "awq", "bits": 4, "group_size": 32})
    word = torch.full((32, 1), 0x06427531, dtype=torch.int32)  # qweight [K, N/8]: K = 32, N = 8
    weight = read_weight(awq, awq.schemes[0].weights, {"qweight": word, "qzeros": torch.zeros(1, 1, dtype=torch.int32),
                                                       "scales": torch.ones(1, 8, dtype=torch.float16)})
    assert weight.dequantize()[:, 0].tolist() == [1, 2, 3, 4, 5, 6, 7, 0]  # output channels 0..7


@pytest.mark.parametrize("kind", list(KINDS))
def test_reader_is_exact(kind):
    """Every layout's weights as our blocks (or, FP8, its e4m3 bytes and scales) equal its
    dequantization, bit for bit; act-order's g_idx becomes a permutation, a trivial one none."""
    torch.manual_seed(0)
    w, order = torch.randn(64, 128), torch.randperm(128)
    q = parse(KINDS[kind].config)
    stored, reference = quantize_layer(kind, w, order)
    weight = read_weight(q, q.scheme_for("model.layers.0.mlp.down_proj").weights, stored)
    if kind in FP8_KINDS:
        assert isinstance(weight, Fp8Weight) and torch.equal(weight.dequantize(), reference.float())
        assert torch.equal(weight.data, stored["weight"].view(torch.uint8))  # the stored bytes, as they are
    else:
        assert isinstance(weight, QuantizedTensor) and weight.format == f"int{KINDS[kind].bits}"
        assert (weight.perm is not None) == KINDS[kind].act_order
        assert torch.equal(weight.dequantize(), reference.float())
    dense = read_weight(q, q.schemes[0].weights, stored, keep_quantized=False)  # --quantization none
    assert torch.equal(dense, reference.float())


REFUSED = {
    "bits 3": ({"quant_method": "gptq", "bits": 3, "group_size": 128}, "gptq with bits 3"),
    "unknown method": ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "'bitsandbytes' is not supported"),
    "awq gemv": ({"quant_method": "awq", "bits": 4, "group_size": 64, "version": "gemv"}, "version 'gemv'"),
    "gptq marlin": ({"quant_method": "gptq", "bits": 4, "group_size": 64, "checkpoint_format": "marlin"},
                    "checkpoint_format 'marlin'"),
    "group not dividing": ({"quant_method": "gptq", "bits": 4, "group_size": 96}, "group_size 96 does not divide"),
    "group of 16": ({"quant_method": "awq", "bits": 4, "group_size": 16}, "group_size 16"),
    "int8 asymmetric": ({"quant_method": "gptq", "bits": 8, "group_size": 32, "sym": False}, "8 bits and sym false"),
    "marlin-24": ({"quant_method": "compressed-tensors", "format": "marlin-24", "config_groups": {}}, "'marlin-24'"),
    "w4a8": (KINDS["ct-w8a8"].config | {"format": "pack-quantized", "config_groups": {"group_0": {
        "targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 32},
        "input_activations": {"num_bits": 8, "type": "int", "strategy": "token", "dynamic": True}}}},
        "int4 weights with int8 dynamic token activations"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_unsupported_configs_are_refused(case):
    config, words = REFUSED[case]
    with pytest.raises(ValueError, match="quantization_config") as e:
        parse(config)
    assert words in str(e.value) and ("supported:" in str(e.value) or "does not divide" in str(e.value))


def test_missing_scale_tensor_is_refused(tmp_path, tiny_bases):
    from safetensors.torch import load_file, save_file
    export(tiny_bases["llama"], tmp_path / "q", tmp_path / "r", "gptq")
    tensors = load_file(str(tmp_path / "q" / "model.safetensors"))
    del tensors["model.layers.1.mlp.up_proj.scales"]
    save_file(tensors, str(tmp_path / "q" / "model.safetensors"))
    with pytest.raises(ValueError, match=r"'model.layers.1.mlp.up_proj.qweight' has no model.layers.1.mlp.up_proj.scales"):
        check_tensors(tmp_path / "q", parse(KINDS["gptq"].config))


# -- Layers ----------------------------------------------------------------------------

def quant_linear(weight: QuantizedTensor) -> QuantLinear:
    n, k = weight.shape
    layer = QuantLinear(k, n, weight.format)
    layer.load_rows(weight, 0)
    return layer


@needs_kernels
def test_act_order_permutation_in_both_kernels():
    """A permuted layer gathers its inputs: the float32 kernels, and the bf16 ones once packed
    (a symmetric GPTQ zero, -8 * scale, is exact in their fp16; an asymmetric one they hold as
    the integer -z, in units of the scale)."""
    torch.manual_seed(0)
    w, order = torch.randn(48, 128), torch.randperm(128)
    grouped = quantize_groups(w, 4, 32, True, order)
    q = parse(KINDS["gptq-int8"].config | {"bits": 4})
    from quant_packing import gptq_tensors
    layer = quant_linear(read_weight(q, q.schemes[0].weights, gptq_tensors(grouped, 4)))
    assert layer.perm is not None and layer.bf16_kernels_exact()
    x = torch.randn(5, 128)
    reference = x.double() @ grouped.dequantize().t()
    assert torch.allclose(layer(x).double(), reference, atol=1e-4)
    if ops.bf16_dot_supported():
        layer.pack()
        xb = x.bfloat16()
        exact = (xb.double() @ grouped.dequantize().t()).float()
        assert torch.allclose(layer(xb).float(), exact, rtol=2**-7, atol=1e-2)
        assert torch.equal(layer.weight.dequantize(), grouped.dequantize().float())
    asym = quant_linear(read_weight(q, q.schemes[0].weights, gptq_tensors(quantize_groups(w, 4, 32, False), 4)))
    assert asym.bf16_kernels_exact() and not torch.equal(asym.zeros.half().float(), asym.zeros)
    if ops.bf16_dot_supported():
        weights = asym.weight.dequantize()
        asym.pack()
        assert asym.zero_units and torch.equal(asym.weight.dequantize(), weights)


def fake_quantized_inputs(x: torch.Tensor) -> torch.Tensor:
    """compressed-tensors' dynamic per-token symmetric int8: scale absmax / 127.5, round, clamp."""
    scale = (x.abs().amax(-1, keepdim=True) / 127.5).clamp(min=torch.finfo(torch.float32).eps)
    return torch.round(x / scale).clamp(-128, 127) * scale


def test_w8a8_quantizes_inputs_as_compressed_tensors_defines():
    torch.manual_seed(0)
    stored, reference = quantize_layer("ct-w8a8", torch.randn(40, 96), torch.arange(96))
    q = parse(KINDS["ct-w8a8"].config)
    layer = quant_linear(read_weight(q, q.schemes[0].weights, stored))
    layer.int8_inputs = True
    x = torch.randn(7, 96) * torch.rand(7, 1) * 10
    expected = fake_quantized_inputs(x.double()) @ reference.t()
    assert torch.allclose(layer(x).double(), expected, rtol=1e-5, atol=1e-4)
    assert not torch.allclose(layer(x).double(), x.double() @ reference.t(), rtol=1e-5, atol=1e-4)


# -- Models ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_bases(tmp_path_factory, bundled_tokenizer):
    return {arch: build_tiny_model(arch, tmp_path_factory.mktemp(arch), bundled_tokenizer)
            for arch in ("llama", "qwen3")}


class FakeQuantInputs(nn.Module):
    """The W8A8 reference: a float32 layer of the dequantized weights on fake-quantized inputs."""

    def __init__(self, dense: nn.Linear) -> None:
        super().__init__()
        self.dense = dense

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dense(fake_quantized_inputs(x))


def use_fake_quant_inputs(llm: LLM) -> None:
    model = llm.engine.model_runner.model
    for name, module in list(model.named_modules()):
        if name.endswith(("qkv_proj", "o_proj", "gate_up_proj", "down_proj")):
            parent, _, attr = name.rpartition(".")
            setattr(model.get_submodule(parent), attr, FakeQuantInputs(module))


def run_pair(folder, reference, w8a8: bool, **engine):
    """Greedy output of `folder` (twice: the second from the prefix cache) against the float32
    model `reference`; the quantized model."""
    llm = LLM(str(folder), dtype="float32", **engine)
    prompts = tiny_prompts()
    ours = [greedy_with_logprobs(llm, prompts, MAX_NEW) for _ in range(2)]  # the second from the cache
    assert llm.engine.stats().num_prefix_cache_hits > 0
    model = llm.engine.model_runner.model
    ref_llm = LLM(str(reference), dtype="float32", **engine)
    if w8a8:
        use_fake_quant_inputs(ref_llm)
    ref = greedy_with_logprobs(ref_llm, prompts, MAX_NEW)
    for run in ours:
        assert check_outputs_match(run, ref) <= int(w8a8)
        worst = max(logprob_gaps(run, ref), default=0.0)
        assert worst < (W8A8_LOGPROB_ATOL if w8a8 else LOGPROB_ATOL), worst
    return model


# The layouts the real quantizers' checkpoints below do not cover (GPTQModel writes symmetric
# 4-bit v1 only), and one Qwen3; every layout's reader is checked above.
MODEL_KINDS = [("llama", "gptq-actorder-asym"), ("llama", "gptq-v2-channel"), ("llama", "gptq-int8"),
               ("qwen3", "gptq-actorder-asym"), ("qwen3", "ct-fp8"), ("llama", "fp8-block")]


@needs_kernels
@pytest.mark.parametrize("arch,kind", MODEL_KINDS)
def test_model_matches_its_dequantized_reference(tmp_path, tiny_bases, arch, kind):
    export(tiny_bases[arch], tmp_path / kind, tmp_path / "reference", kind)
    model = run_pair(tmp_path / kind, tmp_path / "reference", KINDS[kind].layout == "ct-int8", **STRESS)
    qkv = model.model.layers[0].self_attn.qkv_proj
    if kind in FP8_KINDS:
        assert_fp8_as_stored(model, fp8_kernel)
    else:
        assert isinstance(qkv, QuantLinear) and qkv.format == f"int{KINDS[kind].bits}"
        assert (qkv.perm is not None) == KINDS[kind].act_order and qkv.int8_inputs == (kind == "ct-w8a8")
    assert type(model.lm_head) is nn.Linear  # left in float by every quantizer
    assert weight_format(tmp_path / kind, None) == parse(KINDS[kind].config).label


@needs_kernels
@pytest.mark.parametrize("kind", ["gptq-actorder-asym", "fp8-block"])
def test_speculation_on_a_quantized_model_changes_no_token(tmp_path, tiny_bases, kind):
    """n-gram speculation's drafts are verified by the quantized layers (several positions a
    row, act-order's gather and FP8 included): the greedy tokens are those of the same model
    without it, on prompts that repeat themselves so that drafts are proposed and accepted."""
    export(tiny_bases["llama"], tmp_path / kind, tmp_path / "reference", kind)
    prompts = [list(range(5, 25)) * 3, [7, 8, 9, 10] * 8]
    params = SamplingParams(temperature=0, max_tokens=2 * MAX_NEW, ignore_eos=True)
    plain = LLM(str(tmp_path / kind), dtype="float32", **STRESS)
    spec = LLM(str(tmp_path / kind), dtype="float32", speculative_method="ngram", num_speculative_tokens=3,
               prompt_lookup_min=1, **STRESS)  # any token seen before proposes: drafts on a random model
    tokens = [[o.outputs[0].token_ids for o in llm.generate(prompts, params)] for llm in (plain, spec)]
    assert tokens[0] == tokens[1]
    assert spec.engine.scheduler.spec_stats.num_draft_tokens > 0


@needs_kernels
@pytest.mark.parametrize("kind", ["gptq-actorder-asym", "fp8-block"])
def test_lora_on_a_quantized_base_equals_lora_on_its_float_weights(tmp_path, tiny_bases, kind):
    """A peft adapter on every projection around the quantized layers (act-order's gather, FP8)
    gives the tokens, and to the bound above the logprobs, of the same adapter on a float32
    model of the dequantized weights."""
    from transformers import AutoModelForCausalLM

    from bench.lora_adapters import save_random_adapter
    export(tiny_bases["llama"], tmp_path / kind, tmp_path / "reference", kind)
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path / "reference"), dtype=torch.float32)
    adapter = save_random_adapter(hf, tmp_path / "adapter", 8, ["q_proj", "v_proj", "o_proj", "up_proj",
                                                                  "down_proj"], seed=3)
    runs = []
    for folder in (tmp_path / kind, tmp_path / "reference"):
        llm = LLM(str(folder), dtype="float32", enable_lora=True, lora_modules={"a": str(adapter)}, **STRESS)
        params = SamplingParams(temperature=0, max_tokens=MAX_NEW, min_tokens=MAX_NEW, logprobs=5)
        outs = llm.generate(tiny_prompts(), params, lora_name="a")
        runs.append([(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs])
    assert check_outputs_match(runs[0], runs[1]) == 0
    assert max(logprob_gaps(*runs), default=0.0) < LOGPROB_ATOL


def assert_fp8_as_stored(model: nn.Module, kernel: bool) -> None:
    """Every linear layer but the head is an Fp8Linear holding one byte a weight (no float copy)
    where the FP8 kernel runs, else dense."""
    layers = [m for n, m in model.named_modules() if n.endswith(("qkv_proj", "o_proj", "gate_up_proj", "down_proj"))]
    assert len(layers) == 8 and all(type(m) is (Fp8Linear if kernel else nn.Linear) for m in layers)
    for layer in layers if kernel else ():
        n, k = layer.out_features, layer.in_features
        tensors = [t for t in (*layer.buffers(), *vars(layer.packed).values()) if isinstance(t, torch.Tensor)]
        assert layer.packed.data.dtype == torch.uint8 and layer.packed.data.numel() < 2 * n * k
        assert sum(t.numel() * t.element_size() for t in tensors) < 1.5 * n * k


@pytest.mark.skipif(not ops.fp8_bf16_supported(), reason="the FP8 kernel's bf16 path needs AVX512-BF16")
def test_fp8_bfloat16_runs_as_stored(tmp_path, tiny_bases):
    """A bfloat16 model's FP8 layers take its bf16 activations as they are; greedy tokens agree
    with the exact weights on bf16 inputs (bf16 logits tie often: a prompt may diverge once)."""
    export(tiny_bases["llama"], tmp_path / "q", tmp_path / "reference", "fp8-block")
    llm = LLM(str(tmp_path / "q"), dtype="bfloat16", **STRESS)
    model = llm.engine.model_runner.model
    assert_fp8_as_stored(model, True)
    prompts = tiny_prompts()
    ours = greedy_with_logprobs(llm, prompts, MAX_NEW)
    for name, layer in [(n, m) for n, m in model.named_modules() if isinstance(m, Fp8Linear)]:
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent), attr, ExactLinear(layer.weight.dequantize()))
    assert check_outputs_match(ours, greedy_with_logprobs(llm, prompts, MAX_NEW)) < len(prompts) // 2


def test_fp8_under_tensor_parallelism_runs_as_stored(tmp_path, tiny_bases):
    """Block FP8 shards as stored: column-parallel rows take their own block scales, row-parallel
    columns split on their blocks; TP=2 gives TP=1's tokens. A rank width that would cut a
    column block keeps that row-parallel layer dense (blocks of 32, 4 ranks: o_proj's 16)."""
    export(tiny_bases["llama"], tmp_path / "q", tmp_path / "reference", "fp8-block")
    cfg = read_arch_config(tmp_path / "q")
    assert set(linear_formats(tmp_path / "q", cfg, None, tp_size=2).values()) == {"fp8"}
    four = linear_formats(tmp_path / "q", cfg, None, tp_size=4)
    assert not any(name.endswith("o_proj") for name in four) and any(name.endswith("qkv_proj") for name in four)
    kernel = cpu_kernels.available("fp8_linear") and ops.fp8_supported()
    assert_tp2_equals_tp1(tmp_path / "q", lambda layer: all(
        isinstance(m, Fp8Linear) == kernel for m in (layer.self_attn.qkv_proj, layer.mlp.down_proj)))


TP_ENGINE = dict(dtype="float32", num_kv_blocks=96, num_threads=2, max_num_batched_tokens=48)


def assert_tp2_equals_tp1(folder: Path, layer_is_as_expected) -> None:
    """TP=2 gives TP=1's greedy tokens and logprobs (float32); `layer_is_as_expected` is
    asked of rank 0's first decoder layer."""
    prompts = tiny_prompts()
    one = greedy_with_logprobs(LLM(str(folder), **TP_ENGINE), prompts, MAX_NEW)
    llm = LLM(str(folder), tensor_parallel_size=2, **TP_ENGINE)
    try:
        assert layer_is_as_expected(llm.engine.model_runner.model.model.layers[0])
        two = greedy_with_logprobs(llm, prompts, MAX_NEW)
    finally:
        llm.engine.model_runner.close()
    assert check_outputs_match(two, one) == 0
    assert max(logprob_gaps(two, one), default=0.0) < LOGPROB_ATOL


class ExactLinear(nn.Module):
    """A bfloat16 model's quantized layer, exactly: bf16 inputs times the effective weights in
    float32, rounded to bf16 as the kernels' outputs are."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x.float() @ self.weight.t()).to(x.dtype)


@pytest.mark.skipif(not (cpu_kernels.available("quant_linear") and ops.bf16_dot_supported()),
                    reason="the bf16 quantized kernels need AVX512-BF16")
@pytest.mark.parametrize("kind", ["gptq-int8", "awq"])
def test_bfloat16_packs_the_layers_fp16_holds(tmp_path, tiny_bases, kind):
    """int8 blocks (fp32 scales) and AWQ's int4 (zeros -s * z, held as -z in units of the
    scale) pack for the bf16 kernels, and the outputs are those of the exact weights on bf16
    inputs (bf16 logits tie often: a prompt may diverge once at a near-tie, and logprobs agree
    to a logit's ulp or two)."""
    export(tiny_bases["llama"], tmp_path / kind, tmp_path / "reference", kind)
    llm = LLM(str(tmp_path / kind), dtype="bfloat16", **STRESS)
    model = llm.engine.model_runner.model
    layers = {n: m for n, m in model.named_modules() if isinstance(m, QuantLinear)}
    assert len(layers) == 8 and all(m.packed and not m.fp32_kernels for m in layers.values())
    assert all(m.zero_units for m in layers.values()) == (kind == "awq")
    prompts = tiny_prompts()
    ours = greedy_with_logprobs(llm, prompts, MAX_NEW)
    for name, layer in layers.items():
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent), attr, ExactLinear(layer.weight.dequantize()))
    ref = greedy_with_logprobs(llm, prompts, MAX_NEW)
    assert check_outputs_match(ours, ref) < len(prompts) // 2
    assert max(logprob_gaps(ours, ref), default=0.0) < 0.25


def test_tensor_parallel_splits_on_blocks(tmp_path, tiny_bases):
    """TP=2 equals TP=1: column-parallel layers keep their blocks and act-order permutation
    (whole inputs); row-parallel ones of an act-order checkpoint run dense (a rank's columns
    hold pieces of many groups). W8A8 under TP is refused (a token's scale spans the ranks)."""
    export(tiny_bases["llama"], tmp_path / "q", tmp_path / "reference", "gptq-actorder-asym")
    assert_tp2_equals_tp1(tmp_path / "q", lambda layer: (
        isinstance(layer.self_attn.qkv_proj, QuantLinear) and layer.self_attn.qkv_proj.perm is not None
        and type(layer.self_attn.o_proj) is nn.Linear and type(layer.mlp.down_proj) is nn.Linear))
    export(tiny_bases["llama"], tmp_path / "w8a8", tmp_path / "reference8", "ct-w8a8")
    with pytest.raises(ValueError, match="W8A8.*tensor parallelism"):
        LLM(str(tmp_path / "w8a8"), tensor_parallel_size=2, **TP_ENGINE)


# -- The real quantizers' checkpoints (tests/quant_checkpoints.py) -----------------------

REAL_KINDS = ["ct-w4a16", "ct-w4a16-actorder", "ct-w4a16-asym", "ct-w8a16", "ct-w8a8", "ct-fp8", "ct-fp8-block",
              "gptq", "gptq-actorder", "awq", "fp8-block"]


REAL_PAIRS = {"llama": REAL_KINDS, "qwen3": ["gptq-actorder", "ct-w4a16-asym", "ct-w8a8", "fp8-block"]}


@pytest.fixture(scope="module")
def real_checkpoints(tiny_bases) -> dict[str, dict[str, Path]]:
    """Every checkpoint the test below reads, made together (one process per tool, not per
    kind: about a minute less with an empty cache), then cached."""
    quant_checkpoints = pytest.importorskip("quant_checkpoints")
    return {arch: quant_checkpoints.make_checkpoints(kinds, tiny_bases[arch]) for arch, kinds in REAL_PAIRS.items()}


@needs_kernels
@pytest.mark.parametrize("arch,kind", [(arch, kind) for arch, kinds in REAL_PAIRS.items() for kind in kinds])
def test_real_quantizers_checkpoints(tmp_path, tiny_bases, real_checkpoints, arch, kind):
    """Each quantized layer's blocks dequantize to the checkpoint's own dequantization (written
    from the format's definition by quant_checkpoints), to float32 rounding (float32 scales:
    s * q + (-s * z) rounds where s * (q - z) rounds once; fp16/bf16 scales: exactly), and the
    model matches a float32 model of those weights and the checkpoint's other tensors (AWQ's
    smoothing changed its norms)."""
    import quant_checkpoints
    folder = real_checkpoints[arch][kind]
    reference = {name: w.float() for name, w in quant_checkpoints.dequantized_reference(kind, folder).items()}
    cfg = read_arch_config(folder)
    dense = {}
    for name, weight in iter_weights(folder, cfg, keep_quantized=True):
        if name in reference:
            values = weight.dequantize() if isinstance(weight, QuantizedTensor) else weight
            assert (values - reference[name]).abs().max() <= 2**-19 * reference[name].abs().max(), name
        dense[name] = reference.get(name, weight)
    assert set(reference) <= set(dense) and len(reference) >= 7 * cfg.num_layers
    from safetensors.torch import save_file
    shutil.copytree(folder, tmp_path / "reference", ignore=shutil.ignore_patterns("*.safetensors", "config.json"))
    shutil.copy(tiny_bases[arch] / "config.json", tmp_path / "reference")
    save_file({k: v.contiguous() for k, v in dense.items()}, str(tmp_path / "reference" / "model.safetensors"))
    run_pair(folder, tmp_path / "reference", kind == "ct-w8a8", **STRESS)
