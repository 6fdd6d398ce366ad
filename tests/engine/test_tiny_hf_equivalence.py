"""Greedy output equals HF transformers for tiny random-weight Llama (llama3 RoPE scaling),
Qwen2 (qkv bias, tied embeddings), Qwen3 (q/k norm, head_dim != hidden/heads) and Mistral,
saved locally as HF folders, under batching, chunking, prefix caching and preemption."""

from __future__ import annotations

import random

import pytest
import torch

from pagedserve import LLM
from helpers import assert_matches_hf, build_tiny_model, hf_greedy

MAX_NEW = 32
ARCHS = ["llama", "qwen2", "qwen3", "mistral"]
CONFIGS = {
    "batched": {},
    "chunked": dict(max_num_batched_tokens=24, enable_prefix_caching=False),
    "preempted": dict(num_kv_blocks=14, enable_prefix_caching=False),
    "all_at_once": dict(num_kv_blocks=14, max_num_batched_tokens=40, enable_prefix_caching=True),
}


def tiny_prompts(vocab_size: int = 512) -> list[list[int]]:
    rng = random.Random(0)
    prefix = [rng.randrange(3, vocab_size) for _ in range(40)]
    shared = [prefix + [rng.randrange(3, vocab_size) for _ in range(n)] for n in (5, 17, 33)]
    other = [[rng.randrange(3, vocab_size) for _ in range(n)] for n in (1, 3, 16, 70, 150)]
    return shared + other


@pytest.fixture(scope="module", params=ARCHS)
def tiny(request, tmp_path_factory, bundled_tokenizer):
    from transformers import AutoModelForCausalLM
    folder = build_tiny_model(request.param, tmp_path_factory.mktemp(request.param), bundled_tokenizer)
    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    prompts = tiny_prompts()
    return folder, prompts, hf_greedy(hf, prompts, MAX_NEW)


@pytest.mark.parametrize("config", list(CONFIGS))
def test_matches_hf(tiny, config):
    folder, prompts, reference = tiny
    llm = LLM(str(folder), dtype="float32", **CONFIGS[config])
    assert_matches_hf(llm, prompts, reference, MAX_NEW, preempted="num_kv_blocks" in CONFIGS[config])
