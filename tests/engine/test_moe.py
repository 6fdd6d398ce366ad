"""Mixture of experts: the grouped expert op against a per-token reference, routing against
HF's routers, and greedy output equal to HF transformers for tiny random-weight Mixtral
(4 experts, top-2 renormalised) and Qwen3-MoE (8 experts, top-2 not renormalised, one
dense layer) under batching, chunking, prefix caching and preemption; int8 quantizes the
attention but not the experts; TP=2 equals TP=1."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from engine.layers.moe import grouped_experts, reference_experts, route
from pagedserve import LLM
from cpu_kernels import ops
from helpers import (assert_logprobs_close, assert_matches_hf, assert_no_leak, build_tiny_model, check_outputs_match,
                     greedy_with_logprobs, hf_greedy)

MAX_NEW = 16
CONFIGS = {
    "batched": {},
    "chunked": dict(max_num_batched_tokens=24, enable_prefix_caching=False),
    "preempted": dict(num_kv_blocks=9, enable_prefix_caching=False),
    "all_at_once": dict(num_kv_blocks=9, max_num_batched_tokens=40, enable_prefix_caching=True),
}


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def random_experts(num_tokens: int, num_experts: int = 8, top_k: int = 2, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, 32, generator=g)
    w13 = torch.randn(num_experts, 2 * 24, 32, generator=g) / 6
    w2 = torch.randn(num_experts, 32, 24, generator=g) / 5
    # the last expert never chosen; random (distinct) experts per token
    ids = torch.stack([torch.randperm(num_experts - 1, generator=g)[:top_k] for _ in range(num_tokens)])
    weights = torch.rand(num_tokens, top_k, generator=g)
    return x, w13, w2, weights, ids


@pytest.mark.parametrize("num_tokens", [1, 3, 29])
def test_grouped_experts_equal_per_token_reference(num_tokens):
    x, w13, w2, weights, ids = random_experts(num_tokens)
    ours = grouped_experts(x, w13, w2, weights, ids, silu_and_mul)
    torch.testing.assert_close(ours, reference_experts(x, w13, w2, weights, ids, silu_and_mul))
    assert grouped_experts(x[:0], w13, w2, weights[:0], ids[:0], silu_and_mul).shape == (0, 32)


def test_token_output_independent_of_batch():
    x, w13, w2, weights, ids = random_experts(29, seed=1)
    batched = grouped_experts(x, w13, w2, weights, ids, silu_and_mul)
    for t in (0, 7, 28):
        alone = grouped_experts(x[t:t + 1], w13, w2, weights[t:t + 1], ids[t:t + 1], silu_and_mul)
        torch.testing.assert_close(alone[0], batched[t], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("model_type,renormalize", [("mixtral", True), ("qwen3_moe", False), ("qwen3_moe", True)])
def test_routing_matches_hf(model_type, renormalize):
    from transformers import AutoConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter
    cfg = AutoConfig.for_model(model_type, hidden_size=32, num_experts_per_tok=3, num_local_experts=8,
                               num_experts=8, norm_topk_prob=renormalize)
    router = (MixtralTopKRouter if model_type == "mixtral" else Qwen3MoeTopKRouter)(cfg)
    torch.nn.init.normal_(router.weight)
    x = torch.randn(17, 32)
    _, hf_weights, hf_ids = router(x)
    weights, ids = route(F.linear(x, router.weight), 3, renormalize)
    assert torch.equal(ids, hf_ids)
    torch.testing.assert_close(weights, hf_weights.float())
    assert torch.allclose(weights.sum(-1), torch.ones(17)) == renormalize


def tiny_prompts() -> list[list[int]]:
    rng = random.Random(0)
    prefix = [rng.randrange(3, 512) for _ in range(40)]
    shared = [prefix + [rng.randrange(3, 512) for _ in range(n)] for n in (5, 17)]
    return shared + [[rng.randrange(3, 512) for _ in range(n)] for n in (1, 16, 70)]


@pytest.fixture(scope="module", params=["mixtral", "qwen3_moe"])
def tiny(request, tmp_path_factory, bundled_tokenizer):
    from transformers import AutoModelForCausalLM
    folder = build_tiny_model(request.param, tmp_path_factory.mktemp(request.param), bundled_tokenizer)
    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    return folder, hf_greedy(hf, tiny_prompts(), MAX_NEW)


@pytest.mark.parametrize("config", list(CONFIGS))
def test_matches_hf(tiny, config):
    folder, reference = tiny
    llm = LLM(str(folder), dtype="float32", **CONFIGS[config])
    assert_matches_hf(llm, tiny_prompts(), reference, MAX_NEW, preempted="num_kv_blocks" in CONFIGS[config])


def test_int8_quantizes_attention_not_experts(tiny):
    from engine.layers.quantized import QuantLinear
    from engine.models.moe import SparseMoeBlock
    folder, reference = tiny
    llm = LLM(str(folder), dtype="float32", quantization="int8")
    model = llm.engine.model_runner.model
    layers = model.model.layers
    assert isinstance(layers[1].self_attn.qkv_proj, QuantLinear) or not _quant_kernels()
    assert isinstance(layers[1].mlp, SparseMoeBlock) and layers[1].mlp.experts.gate_up_proj.dtype == torch.float32
    ours = greedy_with_logprobs(llm, tiny_prompts()[:3], 4)
    agree = sum(a[0][0] == b[0][0] for a, b in zip(ours, reference))
    assert agree >= 2  # int8 attention: close to, not equal to, the float model
    assert_no_leak(llm)


def _quant_kernels() -> bool:
    import cpu_kernels
    return cpu_kernels.available("quant_linear")


def test_tensor_parallel_equals_single(tiny):
    folder, _ = tiny
    if folder.name.startswith("mixtral"):  # a TP=2 engine costs ~15 s: Qwen3-MoE has sparse and dense layers
        pytest.skip("tensor parallelism is checked on qwen3_moe")
    single = greedy_with_logprobs(LLM(str(folder), dtype="float32", num_threads=2), tiny_prompts(), 8)
    llm = LLM(str(folder), dtype="float32", num_threads=2, tensor_parallel_size=2)
    try:
        split = greedy_with_logprobs(llm, tiny_prompts(), 8)
    finally:
        llm.engine.model_runner.close()
    assert [t for t, _ in split] == [t for t, _ in single]
    for (_, a), (_, b) in zip(split, single):
        for step_a, step_b in zip(a, b):
            for tok, lp in step_b.items():
                assert tok not in step_a or abs(step_a[tok] - lp) < 1e-4


def test_unknown_architecture_names_the_supported_ones(tmp_path):
    import gguf
    from transformers import AutoConfig

    from engine.models.config import ModelArchConfig
    from engine.models.gguf_loader import read_gguf_config
    from engine.models.registry import model_class
    for error in (lambda: ModelArchConfig.from_hf(AutoConfig.for_model("gpt2")), lambda: model_class("gpt2")):
        with pytest.raises(ValueError, match="gpt2.*not supported.*mixtral.*phi3.*qwen3_moe"):
            error()
    for arch, extra in (("qwen3moe", {}), ("llama", {"llama.expert_count": 8})):  # Mixtral GGUFs say llama
        path = tmp_path / f"{arch}.gguf"
        writer = gguf.GGUFWriter(str(path), arch)
        for key, value in extra.items():
            writer.add_uint32(key, value)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.close()
        with pytest.raises(ValueError, match=f"GGUF architecture '{arch}'.*not supported.*llama"):
            read_gguf_config(path)
    with pytest.raises(ValueError, match="partial_rotary_factor 0.5"):
        ModelArchConfig.from_hf(AutoConfig.for_model("phi3", partial_rotary_factor=0.5, pad_token_id=0))


def test_capture_safe_path_equals_grouped():
    """The every-expert form CUDA-graph capture uses (no data-dependent shapes) gives the
    grouped op's result."""
    from engine.layers.moe import _every_expert
    x, w13, w2, weights, ids = random_experts(11, seed=2)
    torch.testing.assert_close(_every_expert(x, w13, w2, weights, ids, silu_and_mul),
                               grouped_experts(x, w13, w2, weights, ids, silu_and_mul))


def test_qwen3_moe_sparse_layers_follow_step_and_mlp_only_layers():
    from helpers import tiny_hf_config

    from engine.models.config import ModelArchConfig
    cfg = ModelArchConfig.from_hf(tiny_hf_config("qwen3_moe", num_hidden_layers=6, decoder_sparse_step=2,
                                                 mlp_only_layers=[3]))
    assert cfg.moe_layers == (1, 5) and cfg.moe_intermediate_size == 32 and not cfg.norm_topk_prob
    mixtral = ModelArchConfig.from_hf(tiny_hf_config("mixtral"))
    assert mixtral.moe_layers == (0, 1) and mixtral.moe_intermediate_size == 128 and mixtral.norm_topk_prob


@pytest.mark.skipif(not (_quant_kernels() and ops.bf16_dot_supported()), reason="the bf16 kernels need AVX512-BF16")
def test_mxfp4_at_load_quantizes_the_experts(tiny):
    """--quantization mxfp4: every sparse block's experts become fp4 blocks (their dense copies
    gone), and the model generates what it does with those experts' MXFP4 values as dense bf16
    (bf16 logits tie often: a prompt may diverge at a near tie; logprobs within bf16's noise).
    float32 is refused: the fp4 experts run on the bf16 kernels."""
    from cpu_kernels import packing
    from engine.models.moe import SparseMoeBlock
    folder, _ = tiny
    llm = LLM(str(folder), dtype="bfloat16", quantization="mxfp4")
    blocks = [layer.mlp for layer in llm.engine.model_runner.model.model.layers if isinstance(layer.mlp, SparseMoeBlock)]
    assert blocks and all(set(b.experts.packed) == {"gate_up_proj", "down_proj"} and b.experts.down_proj is None
                          for b in blocks)
    prompts = tiny_prompts()
    ours = greedy_with_logprobs(llm, prompts, MAX_NEW)
    for block in blocks:  # the same experts, dense: their fp4 values are exact in bf16
        for kind, packed in block.experts.packed.items():
            values = torch.stack([packing.unpack(packing.PackedWeight(packed.format, data, packed.out_features,
                                                                      packed.in_features, units)).dequantize()
                                  for data, units in zip(packed.data, packed.zero_units)])
            setattr(block.experts, kind, torch.nn.Parameter(values.bfloat16(), requires_grad=False))
        block.experts.packed = {}
    llm.engine.reset_prefix_cache()
    dense = greedy_with_logprobs(llm, prompts, MAX_NEW)
    assert check_outputs_match(ours, dense) <= len(prompts) // 2
    assert_logprobs_close(ours, dense, 0.25)
    assert_no_leak(llm)
    with pytest.raises(ValueError, match="bfloat16"):
        LLM(str(folder), dtype="float32", quantization="mxfp4")


@pytest.mark.skipif(not (_quant_kernels() and ops.int8_dot_supported()), reason="the integer MXFP4 kernel needs "
                                                                              "AVX512-VNNI")
def test_mxfp4_at_load_in_int8_arithmetic(tiny, caplog):
    """--quantization mxfp4 --cpu-arithmetic int8: the experts packed for the integer kernel,
    generating near the exact fp4 arithmetic up to each divergence (8-bit activations move the
    numbers; on these tiny random models greedy paths part within a few tokens, as bf16's do).
    int8 is refused off a bfloat16 CPU model, and says so where no layer can take it."""
    from engine.models.moe import SparseMoeBlock
    folder, _ = tiny
    llm = LLM(str(folder), dtype="bfloat16", quantization="mxfp4", cpu_arithmetic="int8")
    blocks = [layer.mlp for layer in llm.engine.model_runner.model.model.layers if isinstance(layer.mlp, SparseMoeBlock)]
    assert blocks and all({p.format for p in b.experts.packed.values()} == {"mxfp4_int8"} for b in blocks)
    prompts = tiny_prompts()
    ours = greedy_with_logprobs(llm, prompts, MAX_NEW)
    exact = greedy_with_logprobs(LLM(str(folder), dtype="bfloat16", quantization="mxfp4"), prompts, MAX_NEW)
    assert_logprobs_close(ours, exact, 0.25)  # measured: at most 0.09 (Mixtral), 0.03 (Qwen3-MoE)
    assert_no_leak(llm)
    with pytest.raises(ValueError, match="bfloat16"):
        LLM(str(folder), dtype="float32", cpu_arithmetic="int8")
    with caplog.at_level("WARNING", logger="pagedserve"):
        LLM(str(folder), dtype="bfloat16", cpu_arithmetic="int8")
    assert "no int4, int8 or MXFP4 weights" in caplog.text


def test_mxfp4_is_refused_before_loading_a_model_without_experts(tmp_path, bundled_tokenizer, monkeypatch):
    """--quantization mxfp4 on a dense model: the error comes before any weight is read."""
    from engine.models import loader
    folder = build_tiny_model("llama", tmp_path / "llama", bundled_tokenizer)
    monkeypatch.setattr(loader, "iter_weights", lambda *a, **k: pytest.fail("weights read before the check"))
    with pytest.raises(ValueError, match="llama has none"):
        LLM(str(folder), dtype="bfloat16", quantization="mxfp4")
