"""--kv-cache-dtype int8 (and fp8) end to end, on CPU.

The bundled GGUF with an int8 cache, under batching, chunked prefill, prefix caching and
preemption: a request's greedy and seeded tokens are the same alone as in a batch; decode
steps run the one-call C++ layers (csrc/decode_layers.cpp reading the int8 cache) with the
Python loop's bits; greedy agreement with the unquantized cache is reported. The block count
follows the bytes per token. Tiny models: Mistral's window (released blocks) on the C++ kernel
against the torch reference; speculative decoding (ngram, and a draft model whose own runner
inherits the format) and n > 1 forks (copy-on-write of int8 blocks) against plain greedy;
tensor parallel; fp8 on the torch backend."""

from __future__ import annotations

import pytest
import torch

from cpu_kernels import ops
from engine.config import EngineConfig
from engine.kv_sizing import num_kv_blocks
from engine.models import cpu_decode
from pagedserve import LLM, SamplingParams
from helpers import assert_logprobs_close, assert_no_leak, build_tiny_model, greedy_with_logprobs

MAX_NEW = 12
STRESS = dict(num_kv_blocks=6, max_num_batched_tokens=40, enable_prefix_caching=True)  # 6 blocks: preemptions
TEXTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a village at the edge of a "
         "great forest, there lived an old clockmaker who"]
KERNELS = ops.int8_kv_available()


@pytest.fixture(scope="module")
def prompts(bundled_tokenizer):
    encoded = [bundled_tokenizer.encode(t) for t in TEXTS]
    return encoded + [encoded[2][:20]]  # a prefix of another prompt: a prefix-cache hit


@pytest.fixture(scope="module")
def int8_llm(bundled_path):
    # bf16 on the integer kernels where they run: the one-call layers' configuration.
    arithmetic = "int8" if ops.int_dot_supported() else "auto"
    llm = LLM(str(bundled_path), dtype="bfloat16", cpu_arithmetic=arithmetic, kv_cache_dtype="int8", **STRESS)
    yield llm
    llm.engine.model_runner.close()


@pytest.fixture
def calls(monkeypatch) -> list[int]:
    """How many rows each one-call decode step ran."""
    seen, original = [], cpu_decode.CpuDecodeLayers.__call__

    def counted(self, x, rope, ctx):
        seen.append(x.shape[0])
        return original(self, x, rope, ctx)
    monkeypatch.setattr(cpu_decode.CpuDecodeLayers, "__call__", counted)
    return seen


def test_int8_cache_layout_and_block_count(int8_llm):
    runner = int8_llm.engine.model_runner
    layers, kv_heads, dim = runner.arch.num_layers, runner.num_kv_heads, runner.arch.head_dim
    assert runner.kv_caches[0].dtype == torch.int8 and runner.kv_caches[0].shape[-1] == dim + 2
    assert runner.backend.name == ("cpu" if KERNELS else "torch")
    per_block = runner._bytes_per_block()
    assert per_block == 2 * layers * kv_heads * (dim + 2) * 16
    bf16_per_block = 2 * layers * kv_heads * dim * 2 * 16
    config = EngineConfig(kv_cache_memory_gb=0.5, device="cpu")
    ratio = num_kv_blocks(config, per_block, None) / num_kv_blocks(config, bf16_per_block, None)
    assert ratio == pytest.approx(2 * dim / (dim + 2), rel=1e-3) and ratio > 1.9  # 1.94 at D = 64


def test_a_request_does_not_depend_on_its_batch(int8_llm, prompts, calls):
    scheduler = int8_llm.engine.scheduler
    preempted = scheduler.num_preemptions
    together = greedy_with_logprobs(int8_llm, prompts, MAX_NEW)
    assert scheduler.num_preemptions > preempted  # 6 blocks hold fewer than all four
    alone = [greedy_with_logprobs(int8_llm, [p], MAX_NEW)[0] for p in prompts]
    # Tokens exactly; logprobs closely: a preempted request's recompute prefills the tokens it
    # had decoded (another arithmetic path, with any KV cache dtype), so the last bits may move.
    assert [t for t, _ in together] == [t for t, _ in alone]
    assert_logprobs_close(together, alone, 1e-3)
    seeded = [SamplingParams(temperature=1.0, seed=100 + i, max_tokens=MAX_NEW) for i in range(len(prompts))]
    batch = [o.outputs[0].token_ids for o in int8_llm.generate(prompts, seeded)]
    assert batch == [int8_llm.generate([p], s)[0].outputs[0].token_ids for p, s in zip(prompts, seeded)]
    if KERNELS and int8_llm.engine.model_runner.model.model.cpu_decode is not None:
        assert max(calls) == len(prompts)  # batched decode steps ran the one-call layers
    assert_no_leak(int8_llm)


def test_one_call_layers_equal_the_python_loop(int8_llm, prompts):
    model = int8_llm.engine.model_runner.model.model
    ours = greedy_with_logprobs(int8_llm, prompts, MAX_NEW)
    if model.cpu_decode is None:
        pytest.skip("the one-call layers do not fit this model here (no integer or bf16 kernels)")
    saved, model.cpu_decode = model.cpu_decode, None
    try:
        assert greedy_with_logprobs(int8_llm, prompts, MAX_NEW) == ours
    finally:
        model.cpu_decode = saved
    assert_no_leak(int8_llm)


def test_greedy_agreement_with_the_unquantized_cache(int8_llm, bundled_path, prompts):
    """Reported, not required equal: tokens agreeing with the bf16 cache's before divergence."""
    arithmetic = "int8" if ops.int_dot_supported() else "auto"
    plain = LLM(str(bundled_path), dtype="bfloat16", cpu_arithmetic=arithmetic, **STRESS)
    try:
        reference = [t for t, _ in greedy_with_logprobs(plain, prompts, MAX_NEW)]
    finally:
        plain.engine.model_runner.close()
    ours = [t for t, _ in greedy_with_logprobs(int8_llm, prompts, MAX_NEW)]
    agreed = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), len(x)) for x, y in zip(ours, reference)]
    print(f"int8 vs bf16 KV cache: greedy tokens agreeing before divergence {agreed} of {MAX_NEW} each")
    assert sum(agreed) >= len(prompts) * MAX_NEW // 3


# -- tiny models ---------------------------------------------------------------------------------

TINY = dict(dtype="float32", num_kv_blocks=20, max_num_batched_tokens=40, max_num_seqs=8)


def tokens(outputs) -> list[list[int]]:
    return [c.token_ids for o in outputs for c in o.outputs]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, bundled_tokenizer):
    folder = tmp_path_factory.mktemp("tiny_kv")
    target = build_tiny_model("llama", folder / "target", bundled_tokenizer, num_key_value_heads=2)
    draft = build_tiny_model("llama", folder / "draft", bundled_tokenizer, num_hidden_layers=1,
                             initializer_range=0.5)
    return target, draft


@pytest.mark.skipif(not KERNELS, reason="the int8 KV kernels are unavailable here")
def test_mistral_window_on_the_kernel_equals_the_torch_reference(tmp_path, bundled_tokenizer):
    """Every layer windowed (24 tokens over blocks of 8): blocks behind the window are released
    under a 12-block pool, requests run past it and are preempted."""
    from test_sliding_window import BLOCK, WINDOW, window_prompts
    folder = build_tiny_model("mistral", tmp_path, bundled_tokenizer, sliding_window=WINDOW)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    prompts = [window_prompts()[i] for i in (0, 3, 5)]  # 53, 23 and 90 tokens
    out = {}
    for backend in ("cpu", "torch"):
        llm = LLM(str(folder), dtype="float32", block_size=BLOCK, num_kv_blocks=12, max_num_batched_tokens=32,
                  kv_cache_dtype="int8", attention_backend=backend)
        out[backend] = tokens(llm.generate(prompts, params))
        assert llm.engine.scheduler.num_preemptions > 0
        assert_no_leak(llm)
    assert out["cpu"] == out["torch"]


def tiny_prompts() -> list[list[int]]:
    from test_tiny_hf_equivalence import tiny_prompts as prompts
    return prompts()[1:6]  # 57 tokens with a 40-token prefix shared, 73 alike, 1, 3 and 16


def test_draft_speculation_and_forks_keep_greedy_tokens(tiny):
    """Drafts verified against the int8 cache (the draft model's own runner has one too), and
    n = 2 forks sharing the prompt's blocks, its partly filled last block copied on write."""
    target, draft = tiny
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = LLM(str(target), kv_cache_dtype="int8", **TINY)
    expected = tokens(plain.generate(tiny_prompts(), params))
    forked = plain.generate(tiny_prompts(), SamplingParams(n=2, temperature=0, max_tokens=24, ignore_eos=True))
    assert tokens(forked) == [t for t in expected for _ in range(2)]
    assert_no_leak(plain)
    llm = LLM(str(target), num_speculative_tokens=3, kv_cache_dtype="int8", speculative_model=str(draft), **TINY)
    assert tokens(llm.generate(tiny_prompts(), params)) == expected
    assert llm.engine.stats().spec_decoding.num_drafts > 0
    draft_runner = llm.engine.speculator.proposer.runner
    assert draft_runner.kv_caches[0].shape[-1] == draft_runner.arch.head_dim + 2
    assert_no_leak(llm)


def test_tensor_parallel_int8_equals_one_rank(tiny):
    target, _ = tiny
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    one = LLM(str(target), kv_cache_dtype="int8", **TINY)
    expected = tokens(one.generate(tiny_prompts()[:3], params))
    two = LLM(str(target), kv_cache_dtype="int8", tensor_parallel_size=2, **TINY)
    try:
        assert two.engine.model_runner.kv_caches[0].shape[1] == 1  # a kv head per rank
        assert tokens(two.generate(tiny_prompts()[:3], params)) == expected
        assert_no_leak(two)
    finally:
        two.engine.model_runner.close()


def test_fp8_runs_on_the_torch_path(tiny):
    target, _ = tiny
    llm = LLM(str(target), kv_cache_dtype="fp8", **TINY)
    runner = llm.engine.model_runner
    assert runner.kv_caches[0].dtype == torch.float8_e4m3fn
    assert runner._bytes_per_block() == 2 * runner.arch.num_layers * runner.num_kv_heads * runner.arch.head_dim * 16
    out = llm.generate(tiny_prompts(), SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=16))
    assert all(len(c.token_ids) == 16 for o in out for c in o.outputs)
    assert_no_leak(llm)
