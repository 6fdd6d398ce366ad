"""Phi-3: greedy output equals HF transformers for a tiny random-weight Phi-3 (fused qkv and
gate_up checkpoint tensors, LongRoPE with a 64-token original length) in both LongRoPE
regimes, under batching, chunking, prefix caching and preemption.

HF uses the short factors while a sequence fits the original length and the long ones
(recomputing the cache) beyond it; we choose once per engine, by max_model_len (see
engine/layers/rotary.py `longrope_params`). So the short regime is checked on an engine
of max_model_len 64 with sequences that stay within 64 tokens, the long regime on an
engine of 512 positions with prompts longer than 64 tokens."""

from __future__ import annotations

import random

import pytest
import torch

from engine.layers.rotary import RotaryEmbedding
from engine.models.config import ModelArchConfig
from pagedserve import LLM
from helpers import assert_matches_hf, assert_no_leak, build_tiny_model, greedy_with_logprobs, hf_greedy, tiny_hf_config

MAX_NEW = 16
ORIGINAL = 64  # tiny_hf_config("phi3")'s original_max_position_embeddings
CONFIGS = {
    "batched": {},
    "chunked": dict(max_num_batched_tokens=24, enable_prefix_caching=False),
    "preempted": dict(num_kv_blocks=True, enable_prefix_caching=False),
    "all_at_once": dict(num_kv_blocks=True, max_num_batched_tokens=40, enable_prefix_caching=True),
}
# regime -> (engine max_model_len, prompt lengths after a shared prefix, other prompt lengths,
# prefix length, KV blocks that force preemptions)
REGIMES = {"short": (ORIGINAL, (3, 12), (1, 9, 30), 20, 6), "long": (512, (5, 17), (65, 66, 100), 70, 11)}


def prompts(regime: str) -> list[list[int]]:
    _, shared, other, prefix_len, _ = REGIMES[regime]
    rng = random.Random(0)
    prefix = [rng.randrange(3, 512) for _ in range(prefix_len)]
    out = [prefix + [rng.randrange(3, 512) for _ in range(n)] for n in shared]
    out += [[rng.randrange(3, 512) for _ in range(n)] for n in other]
    lengths = [len(p) + MAX_NEW for p in out]
    assert all(n <= ORIGINAL for n in lengths) if regime == "short" else min(map(len, out)) > ORIGINAL
    return out


@pytest.mark.parametrize("max_positions", [ORIGINAL, 512])
def test_rope_table_matches_hf(max_positions):
    """Our cos/sin table (short factors up to the original length, long beyond, both scaled
    by the attention factor) equals HF's for a sequence of that many positions."""
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding
    config = tiny_hf_config("phi3")
    arch = ModelArchConfig.from_hf(config)
    ours = RotaryEmbedding(arch.head_dim, max_positions, arch.rope_theta, arch.rope_scaling)
    cos, sin = Phi3RotaryEmbedding(config)(torch.zeros(1), torch.arange(max_positions)[None])
    torch.testing.assert_close(ours.cos, cos[0])
    torch.testing.assert_close(ours.sin, sin[0])
    assert ours.cos[0, 0] > 1.0  # the attention factor (max 512 / original 64 -> 1.22) applies


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, bundled_tokenizer):
    from transformers import AutoModelForCausalLM
    folder = build_tiny_model("phi3", tmp_path_factory.mktemp("phi3"), bundled_tokenizer)
    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    return folder, {regime: hf_greedy(hf, prompts(regime), MAX_NEW) for regime in REGIMES}


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("regime", list(REGIMES))
def test_matches_hf(tiny, regime, config):
    folder, reference = tiny
    kwargs = dict(CONFIGS[config])
    if "num_kv_blocks" in kwargs:
        kwargs["num_kv_blocks"] = REGIMES[regime][4]
    llm = LLM(str(folder), dtype="float32", max_model_len=REGIMES[regime][0], **kwargs)
    assert_matches_hf(llm, prompts(regime), reference[regime], MAX_NEW,
                      preempted="num_kv_blocks" in CONFIGS[config])


def test_regime_is_per_engine_not_per_batch(tiny):
    """A short sequence on a long-context engine gets the long factors, whatever its batch
    (here: alone, and batched with long prompts): the same tokens either way."""
    folder, _ = tiny
    llm = LLM(str(folder), dtype="float32")
    short = prompts("short")[:2]
    alone = greedy_with_logprobs(llm, short, MAX_NEW)
    mixed = greedy_with_logprobs(llm, short + prompts("long"), MAX_NEW)[:2]
    assert [t for t, _ in alone] == [t for t, _ in mixed]
    assert_no_leak(llm)
