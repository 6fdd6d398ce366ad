"""Real sliding-window attention against HF transformers: a tiny Mistral (every layer
windowed, so out-of-window blocks are released) and a tiny Qwen2 whose second layer only
is windowed (Gemma 3's mix: nothing released, the windowed layer masks), with a window
of 24 tokens over blocks of 8, and prompts and generations far longer than the window,
under batching, chunking, prefix caching and preemption."""

from __future__ import annotations

import random

import pytest
import torch

from pagedserve import LLM, SamplingParams
from helpers import Oracle, assert_matches_hf, assert_no_leak, build_tiny_model, check_outputs_match, hf_greedy

WINDOW, BLOCK = 24, 8
MAX_NEW = 48
CONFIGS = {
    "batched": dict(enable_prefix_caching=False),
    "chunked": dict(max_num_batched_tokens=20, enable_prefix_caching=False),
    "cached": dict(max_num_batched_tokens=64, enable_prefix_caching=True),
    # The others run "auto" (the cpu backend's kernel where it builds); this one the torch backend.
    "preempted": dict(max_num_batched_tokens=32, enable_prefix_caching=True, attention_backend="torch"),
}
# num_kv_blocks for "preempted": Mistral releases blocks behind the window, so 12 blocks
# (96 tokens) run 138-token requests.
PREEMPT_BLOCKS = {"mistral": 12, "qwen2_mixed": 20}
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
    extra = dict(num_kv_blocks=PREEMPT_BLOCKS[name]) if config == "preempted" else {}
    llm = LLM(str(folder), dtype="float32", block_size=BLOCK, **CONFIGS[config], **extra)
    assert_matches_hf(llm, prompts, reference, MAX_NEW, preempted=bool(extra))


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


def test_mistral_releases_blocks_behind_the_window(windowed):
    """One request longer than the whole pool runs, and holds a bounded number of blocks."""
    name, folder, prompts, reference = windowed
    if name != "mistral":
        pytest.skip("only a model whose every layer is windowed releases blocks")
    llm = LLM(str(folder), dtype="float32", block_size=BLOCK, num_kv_blocks=10, max_num_batched_tokens=16)
    assert llm.engine.max_model_len == 512  # neither the window nor the 80-token pool caps it
    bm, held = llm.engine.block_manager, []
    append_slots = bm.append_slots

    def recording(*args, **kwargs):
        ok = append_slots(*args, **kwargs)
        held.append(bm.num_blocks - bm.num_free_blocks)
        return ok
    bm.append_slots = recording
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, min_tokens=MAX_NEW, logprobs=5)
    out = llm.generate(prompts[-1:], params)[0].outputs[0]  # 90 + 48 tokens, 18 blocks' worth
    assert check_outputs_match([(out.token_ids, out.logprobs)], reference[-1:]) == 0
    assert max(held) <= bm.window_peak_blocks(16 + 4) == 7
    assert llm.engine.stats().num_preemptions == 0
    assert_no_leak(llm)


def test_mistral_speculation_and_forks_under_the_window(windowed):
    """Verification rows and copy-on-write siblings (n=2) over released blocks."""
    name, folder, prompts, reference = windowed
    if name != "mistral":
        pytest.skip("the released-block paths are Mistral's")
    llm = LLM(str(folder), dtype="float32", block_size=BLOCK, num_kv_blocks=24, speculative_method="ngram",
              num_speculative_tokens=3)
    llm.engine.speculator.proposer = Oracle({tuple(p): r[0] for p, r in zip(prompts, reference)})
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, min_tokens=MAX_NEW, n=2)
    outs = llm.generate(prompts[-2:], params)
    for out, (tokens, _) in zip(outs, reference[-2:]):
        assert [c.token_ids for c in out.outputs] == [tokens, tokens]
    assert llm.engine.stats().spec_decoding.num_accepted_tokens > 0
    assert_no_leak(llm)
