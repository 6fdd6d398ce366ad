"""Real sliding-window attention against HF transformers: a tiny Mistral (every layer
windowed, so out-of-window blocks are released) and a tiny Qwen2 whose second layer only
is windowed (Gemma 3's mix: nothing released, the windowed layer masks), with a window
of 24 tokens over blocks of 8, and prompts and generations far longer than the window,
under batching, chunking, prefix caching and preemption."""

from __future__ import annotations

import random

import pytest
import torch

from engine import LLM, SamplingParams
from helpers import assert_no_leak, build_tiny_model, check_outputs_match, hf_greedy

WINDOW, BLOCK = 24, 8
MAX_NEW = 48
CONFIGS = {
    "batched": dict(enable_prefix_caching=False),
    "chunked": dict(max_num_batched_tokens=20, enable_prefix_caching=False),
    "cached": dict(max_num_batched_tokens=64, enable_prefix_caching=True),
    "preempted": dict(num_kv_blocks=20, max_num_batched_tokens=32, enable_prefix_caching=True),
}
MODELS = {
    "mistral": dict(sliding_window=WINDOW),
    "qwen2_mixed": dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1),
}


def window_prompts(vocab_size: int = 512) -> list[list[int]]:
    rng = random.Random(1)
    prefix = [rng.randrange(3, vocab_size) for _ in range(50)]
    shared = [prefix + [rng.randrange(3, vocab_size) for _ in range(n)] for n in (3, 30)]
    return shared + [[rng.randrange(3, vocab_size) for _ in range(n)] for n in (2, 23, 25, 90)]


@pytest.fixture(scope="module", params=list(MODELS))
def windowed(request, tmp_path_factory, bundled_tokenizer):
    from transformers import AutoModelForCausalLM
    model_type = request.param.split("_")[0]
    folder = build_tiny_model(model_type, tmp_path_factory.mktemp(request.param), bundled_tokenizer,
                              **MODELS[request.param])
    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    prompts = window_prompts()
    return request.param, folder, prompts, hf_greedy(hf, prompts, MAX_NEW)


@pytest.mark.parametrize("config", list(CONFIGS))
def test_matches_hf(windowed, config):
    name, folder, prompts, reference = windowed
    llm = LLM(str(folder), dtype="float32", block_size=BLOCK, **CONFIGS[config])
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, min_tokens=MAX_NEW, logprobs=5)
    runs = 2 if llm.config.enable_prefix_caching else 1
    for _ in range(runs):  # with caching, the second run is served from the prefix cache
        outs = llm.generate(prompts, params)
        ours = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]
        assert check_outputs_match(ours, reference) <= 1
    stats = llm.engine.stats()
    if "num_kv_blocks" in CONFIGS[config]:
        assert stats.num_preemptions > 0
    if llm.config.enable_prefix_caching:
        assert stats.num_prefix_cache_hits > 0
    assert_no_leak(llm)


def test_window_changes_the_output(windowed):
    """The reference really is windowed: full attention would generate other tokens."""
    name, folder, prompts, reference = windowed
    from transformers import AutoConfig, AutoModelForCausalLM
    config = AutoConfig.from_pretrained(str(folder))
    if getattr(config, "layer_types", None):
        config.layer_types = ["full_attention"] * config.num_hidden_layers
    else:
        config.sliding_window = None
    hf = AutoModelForCausalLM.from_pretrained(str(folder), config=config, dtype=torch.float32).eval()
    full = hf_greedy(hf, prompts[-1:], MAX_NEW)
    assert full[0][0] != reference[-1][0]
