"""Greedy output of our engine equals HF transformers, token for token, on the bundled
SmolLM2 (both loaded from the same GGUF, dequantized to fp32), under batching, chunked prefill,
prefix caching and preemption, separately and all at once."""

from __future__ import annotations

import pytest

from pagedserve import LLM, SamplingParams
from helpers import assert_no_leak, check_outputs_match, hf_greedy

pytestmark = pytest.mark.heavy(72)  # seconds on the 2-core CI machine: scheduled first

MAX_NEW = 32
SHARED_PREFIX = (
    "You are a meticulous assistant who answers questions about geography, history and science. "
    "Always give a short, direct answer first, then one sentence of explanation, and never invent "
    "facts. If you are unsure, say so plainly and suggest where the reader could check. "
    "Keep a friendly, patient tone, avoid jargon unless the reader uses it first, and when a "
    "question has several parts, answer each part in order. ")
QUESTIONS = [
    "What is the capital of France?", "Why is the sky blue?", "Who wrote Hamlet?",
    "How far is the Moon from the Earth?",
]
OTHER = [
    "Hello", "The quick brown fox", "def fibonacci(n):",
    "Once upon a time, in a village at the edge of a great forest, there lived an old clockmaker "
    "who had not spoken to anyone for many years. One winter morning, a knock came at his door,",
]


@pytest.fixture(scope="module")
def prompts(bundled_tokenizer) -> list[list[int]]:
    texts = [SHARED_PREFIX + q for q in QUESTIONS] + OTHER
    return [bundled_tokenizer.encode(t) for t in texts]


@pytest.fixture(scope="module")
def reference(bundled_hf_model, prompts):
    return hf_greedy(bundled_hf_model, prompts, MAX_NEW)


def run(llm: LLM, prompts):
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, min_tokens=MAX_NEW, logprobs=5)
    outs = llm.generate(prompts, params)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]


def engine(bundled_path, **config) -> LLM:
    # quantization "none": HF reads the GGUF dequantized to float32, so must we. The
    # quantized layers are checked against their own reference in test_quantized_model.py.
    return LLM(str(bundled_path), dtype="float32", quantization="none", **config)


def test_prompts_are_mixed(prompts):
    lengths = sorted(len(p) for p in prompts)
    assert len(prompts) >= 8 and lengths[0] < 8 and lengths[-1] > 64, lengths


def test_batched(bundled_path, prompts, reference):
    llm = engine(bundled_path)
    assert check_outputs_match(run(llm, prompts), reference) <= 1
    assert_no_leak(llm)


def test_chunked_prefill(bundled_path, prompts, reference):
    llm = engine(bundled_path, max_num_batched_tokens=24, enable_prefix_caching=False)
    assert max(len(p) for p in prompts) > 24  # so the long prompts must be chunked
    assert check_outputs_match(run(llm, prompts), reference) <= 1
    assert_no_leak(llm)


def test_prefix_caching_second_run_hits(bundled_path, prompts, reference):
    llm = engine(bundled_path, enable_prefix_caching=True)
    first = run(llm, prompts)
    hits_after_first = llm.engine.stats().num_prefix_cache_hits
    assert hits_after_first > 0  # the shared system prefix, within the first batch already
    second = run(llm, prompts)
    stats = llm.engine.stats()
    # the second run finds (at least) every full block of every prompt but the last token's
    expected = sum((len(p) - 1) // 16 * 16 for p in prompts)
    assert stats.num_prefix_cache_hits - hits_after_first >= expected
    assert check_outputs_match(first, reference) <= 1
    assert check_outputs_match(second, reference) <= 1
    assert_no_leak(llm)


def test_preemption(bundled_path, prompts, reference):
    llm = engine(bundled_path, num_kv_blocks=16, enable_prefix_caching=False)
    assert check_outputs_match(run(llm, prompts), reference) <= 1
    assert llm.engine.scheduler.num_preemptions > 0
    assert_no_leak(llm)


def test_everything_at_once(bundled_path, prompts, reference):
    llm = engine(bundled_path, num_kv_blocks=16, max_num_batched_tokens=40, enable_prefix_caching=True)
    first, second = run(llm, prompts), run(llm, prompts)
    stats = llm.engine.stats()
    assert stats.num_preemptions > 0 and stats.num_prefix_cache_hits > 0
    assert check_outputs_match(first, reference) <= 1
    assert check_outputs_match(second, reference) <= 1
    assert_no_leak(llm)
