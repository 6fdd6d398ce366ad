"""A decode step's layers in one C++ call (engine/models/cpu_decode.py) give the Python loop's
bits: the same tokens and logprobs, on the exact bf16 kernels and the integer ones, for the
bundled GGUF under chunked prefill, prefix caching and preemption, and for tiny models with the
parts the op passes on (Qwen2's qkv bias, Mistral's sliding window, Qwen3's q/k norms, Phi-3's
LongRoPE tables). Models it does not fit run the Python loop."""

from __future__ import annotations

import random

import pytest

from cpu_kernels import ops
from engine.models import cpu_decode
from pagedserve import LLM
from helpers import assert_no_leak, build_tiny_model, greedy_with_logprobs

MAX_NEW = 12
STRESS = dict(num_kv_blocks=24, max_num_batched_tokens=40, enable_prefix_caching=True)
TEXTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a village at the edge of a "
         "great forest, there lived an old clockmaker who"]
ARITHMETICS = [
    pytest.param("auto", marks=pytest.mark.skipif(not ops.bf16_dot_supported(),
                                                  reason="the exact bf16 kernels need AVX512-BF16")),
    pytest.param("int8", marks=pytest.mark.skipif(not ops.int_dot_supported(),
                                                  reason="the integer kernels need AVX2")),
]


@pytest.fixture
def calls(monkeypatch) -> list[int]:
    """How many rows each one-call step ran."""
    seen, original = [], cpu_decode.CpuDecodeLayers.__call__

    def counted(self, x, rope, ctx):
        seen.append(x.shape[0])
        return original(self, x, rope, ctx)
    monkeypatch.setattr(cpu_decode.CpuDecodeLayers, "__call__", counted)
    return seen


def tiny_prompts() -> list[list[int]]:
    """Random ids of the tiny models' 512-token vocabulary: 3 to 30 tokens, past an 8-token window."""
    rng = random.Random(0)
    return [[rng.randrange(3, 512) for _ in range(n)] for n in (3, 11, 30)]


def python_loop(llm: LLM) -> None:
    llm.engine.model_runner.model.model.cpu_decode = None


@pytest.mark.parametrize("arithmetic", ARITHMETICS)
def test_bundled_model_equals_the_python_loop(bundled_path, bundled_tokenizer, arithmetic, calls):
    prompts = [bundled_tokenizer.encode(t) for t in TEXTS]
    prompts.append(prompts[2][:20])  # a prefix of another prompt: a prefix-cache hit
    llm = LLM(str(bundled_path), dtype="bfloat16", cpu_arithmetic=arithmetic, **STRESS)
    try:
        ours = greedy_with_logprobs(llm, prompts, MAX_NEW)
        assert max(calls) == len(prompts) and min(calls) >= 1  # batched decode steps, and lone ones
        assert_no_leak(llm)
        python_loop(llm)
        done = len(calls)
        assert greedy_with_logprobs(llm, prompts, MAX_NEW) == ours
        assert len(calls) == done
    finally:
        llm.engine.model_runner.close()


@pytest.mark.parametrize("arithmetic", ARITHMETICS)
@pytest.mark.parametrize("arch, overrides", [("qwen2", {}), ("mistral", {"sliding_window": 8}), ("qwen3", {}),
                                             ("phi3", {})])
def test_family_parts_equal_the_python_loop(tmp_path, bundled_tokenizer, arch, overrides, arithmetic, calls):
    folder = build_tiny_model(arch, tmp_path / arch, bundled_tokenizer, **overrides)
    prompts = tiny_prompts()
    llm = LLM(str(folder), dtype="bfloat16", quantization="int4", cpu_arithmetic=arithmetic,
              enable_prefix_caching=False)
    try:
        ours = greedy_with_logprobs(llm, prompts, MAX_NEW)
        assert calls
        python_loop(llm)
        assert greedy_with_logprobs(llm, prompts, MAX_NEW) == ours
    finally:
        llm.engine.model_runner.close()


def test_models_it_does_not_fit_run_the_python_loop(tmp_path, bundled_tokenizer, calls):
    folder = build_tiny_model("llama", tmp_path / "llama", bundled_tokenizer)
    llm = LLM(str(folder), dtype="float32", quantization="int4", enable_prefix_caching=False)
    try:
        greedy_with_logprobs(llm, tiny_prompts()[:1], 4)
        model = llm.engine.model_runner.model.model
        assert model.cpu_decode is None and not calls
        assert "neither CPU kernel" in cpu_decode.unfit_reason(model)  # float32: the float32 kernels
    finally:
        llm.engine.model_runner.close()
