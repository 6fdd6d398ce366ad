"""Quantized layers in the engine: the bundled GGUF's Q4_1/Q8_0 run as stored, and a float
checkpoint quantized at load (int4, int8); each against its own reference, the model of
exactly its dequantized weights (float32 layers), under batching, chunked prefill, prefix
caching and preemption at once: in float32, and in bfloat16 through the bf16 kernels where
the CPU has them. And the fallbacks."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from torch import nn

import cpu_kernels
from cpu_kernels import dispatch, ops
from engine.layers.quantized import QuantEmbedding, QuantLinear, dequantize_modules
from pagedserve import LLM, SamplingParams
from helpers import assert_logprobs_close, assert_no_leak, build_tiny_model, check_outputs_match
from test_tiny_hf_equivalence import tiny_prompts

needs_kernels = pytest.mark.skipif(not cpu_kernels.available("quant_linear"),
                                   reason=f"CPU kernels unavailable: {cpu_kernels.unavailable_reason('quant_linear')}")
MAX_NEW = 16
STRESS = dict(num_kv_blocks=24, max_num_batched_tokens=40, enable_prefix_caching=True)


def use_reference(llm: LLM) -> int:
    """Swap the quantized layers for dense float32 ones holding their effective weights."""
    model = llm.engine.model_runner.model
    count = sum(isinstance(m, QuantLinear) for m in model.modules())
    dequantize_modules(model, torch.float32)
    return count


class ExactLinear(nn.Module):
    """The bf16 kernels' reference: bf16 activations times the exact effective weights (in
    AMX arithmetic, those rounded to bf16), in float32, rounded to bf16 as the kernel's
    output is."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x.float() @ self.weight.t()).to(x.dtype)


def use_bf16_reference(llm: LLM) -> int:
    """Swap the packed layers for ExactLinear (the tied embedding keeps reading the table)."""
    model = llm.engine.model_runner.model
    names = [n for n, m in model.named_modules(remove_duplicate=False) if isinstance(m, QuantLinear) and m.packed
             and not n.endswith(".table")]
    for name in names:
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        layer = getattr(parent, attr)
        weight = layer.weight.dequantize()
        setattr(parent, attr, ExactLinear(weight.bfloat16().float() if layer.amx else weight))
    return len(names)


def greedy(llm: LLM, prompts) -> list:
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, min_tokens=MAX_NEW, logprobs=5)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in llm.generate(prompts, params)]


@needs_kernels
def test_bundled_gguf_runs_as_stored_and_matches_its_reference(bundled_path, bundled_tokenizer):
    texts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a village at "
             "the edge of a great forest, there lived an old clockmaker who", "Hello"]
    prompts = [bundled_tokenizer.encode(t) for t in texts] + [bundled_tokenizer.encode(texts[2])[:20]]
    llm = LLM(str(bundled_path), dtype="float32", **STRESS)
    model = llm.engine.model_runner.model
    layer = model.model.layers[0]
    assert layer.self_attn.qkv_proj.format == "int4" and layer.mlp.down_proj.format == "int4"  # Q4_1
    assert model.lm_head.format == "int8" and isinstance(model.model.embed_tokens, QuantEmbedding)  # Q8_0, tied
    with open("/proc/self/maps") as maps:  # the weights are copies: the file is no longer mapped
        assert str(bundled_path.resolve()) not in maps.read()
    ours = greedy(llm, prompts)
    assert_no_leak(llm)
    assert use_reference(llm) == 4 * len(model.model.layers) + 1
    ref = greedy(llm, prompts)
    assert check_outputs_match(ours, ref) <= 1
    assert_logprobs_close(ours, ref, 1e-3)
    assert_no_leak(llm)


@pytest.mark.skipif(not (cpu_kernels.available("quant_linear") and ops.bf16_dot_supported()),
                    reason="the bf16 quantized kernels need AVX512-BF16")
@pytest.mark.parametrize("arithmetic", ["avx512_bf16", pytest.param("amx", marks=pytest.mark.skipif(
    not ops.bf16_amx_ready(), reason="no AMX tiles on this CPU, or no permission"))])
def test_bundled_gguf_in_bfloat16_matches_its_reference(bundled_path, bundled_tokenizer, arithmetic, monkeypatch):
    """bf16 activations, exact weights: the only difference from the reference is the order of
    the fp32 sums, seen through bf16 roundings. bf16 logits (about 16, so 1/16 apart) tie
    often, so each prompt may diverge once at a near-tie (check_outputs_match checks that
    each side's token is in the other's top 5), and logprobs agree to a logit's ulp or two."""
    texts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a village at "
             "the edge of a great forest, there lived an old clockmaker who"]
    prompts = [bundled_tokenizer.encode(t) for t in texts] + [bundled_tokenizer.encode(texts[2])[:20]]
    monkeypatch.setenv(dispatch.ENV, arithmetic)
    llm = LLM(str(bundled_path), dtype="bfloat16", **STRESS)
    model = llm.engine.model_runner.model
    assert model.model.layers[0].mlp.down_proj.packed and model.lm_head.packed
    assert model.lm_head.amx == (arithmetic == "amx")
    ours = greedy(llm, prompts)
    assert_no_leak(llm)
    assert use_bf16_reference(llm) == 4 * len(model.model.layers) + 1
    ref = greedy(llm, prompts)
    assert check_outputs_match(ours, ref) < len(prompts)
    assert_logprobs_close(ours, ref, 0.25)
    assert_no_leak(llm)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory, bundled_tokenizer):
    return build_tiny_model("llama", tmp_path_factory.mktemp("llama"), bundled_tokenizer)


@needs_kernels
@pytest.mark.parametrize("fmt", ["int4", "int8"])
def test_float_checkpoint_quantized_at_load_matches_its_reference(tiny_llama, fmt):
    llm = LLM(str(tiny_llama), dtype="float32", quantization=fmt, **STRESS)
    prompts = tiny_prompts()
    ours = greedy(llm, prompts)
    assert use_reference(llm) == 4 * 2 + 1  # two layers' four linears and the (untied) head
    assert isinstance(llm.engine.model_runner.model.model.embed_tokens, nn.Embedding)
    ref = greedy(llm, prompts)
    assert check_outputs_match(ours, ref) <= 1
    assert_logprobs_close(ours, ref, 1e-3)
    assert_no_leak(llm)


def test_quantization_none_dequantizes_the_gguf(bundled_path):
    llm = LLM(str(bundled_path), dtype="float32", quantization="none", num_kv_blocks=16)
    model = llm.engine.model_runner.model
    assert not any(isinstance(m, QuantLinear) for m in model.modules())
    assert model.lm_head.weight is model.model.embed_tokens.weight  # still tied


def test_quantizing_a_gguf_again_is_refused(bundled_path):
    with pytest.raises(ValueError, match="run as stored"):
        LLM(str(bundled_path), quantization="int8", num_kv_blocks=16)


def test_without_kernels_the_layers_are_dense_with_the_same_weights(tiny_llama):
    """PAGEDSERVE_CPU_KERNELS=0 stands in for a machine where they cannot build: the model
    still loads and serves, with the effective weights, and one warning says why."""
    script = f"""
import logging, torch
logging.basicConfig(level=logging.WARNING)
from torch import nn
from engine.layers.quantized import quantize
from pagedserve import LLM, SamplingParams
from safetensors.torch import load_file
llm = LLM({str(tiny_llama)!r}, dtype="float32", quantization="int4", num_kv_blocks=16)
layer = llm.engine.model_runner.model.model.layers[0].mlp.down_proj
assert type(layer) is nn.Linear, type(layer)
stored = load_file({str(tiny_llama / "model.safetensors")!r})["model.layers.0.mlp.down_proj.weight"]
assert torch.equal(layer.weight, quantize(stored, "int4").dequantize())
out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
assert len(out[0].outputs[0].token_ids) == 4
print("ok")
"""
    env = {**os.environ, "PAGEDSERVE_CPU_KERNELS": "0"}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]
    warnings = [line for line in done.stderr.splitlines() if "CPU kernels 'quant_linear' unavailable" in line]
    assert len(warnings) == 1 and "PAGEDSERVE_CPU_KERNELS=0" in warnings[0], done.stderr[-3000:]
