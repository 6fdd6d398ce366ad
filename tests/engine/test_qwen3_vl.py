"""Qwen3-VL end to end in the offline `LLM` against HF transformers, greedy, in float32: a tiny
random-weight model with a real vision tower and DeepStack, Qwen2.5-VL's conversations (0, 1
and 3 images of different sizes and aspect ratios, batched with text-only ones) under chunked
prefill that splits every image (so DeepStack's levels arrive a slice per step), prefix
caching and preemption. The prompt and pixels our frontend makes equal transformers'
Qwen3VLProcessor's exactly."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from helpers import assert_matches_hf, assert_no_leak
from pagedserve import LLM, SamplingParams
from test_qwen2_5_vl import CONVERSATIONS, MAX_NEW
from vl_models import build_tiny_qwen3_vl, conversation, hf_greedy, hf_inputs, hf_processor, hf_qwen3_vl, picture

pytestmark = pytest.mark.heavy(25)

CONFIGS = {
    "batched": {},
    # 5-token chunks: every image (6 to 24 tokens of 32x32 pixels) is split across steps
    "chunked": {"max_num_batched_tokens": 5, "enable_prefix_caching": False},
    "preempted": {"num_kv_blocks": 6, "enable_prefix_caching": False},
    "all_at_once": {"num_kv_blocks": 8, "max_num_batched_tokens": 24, "enable_prefix_caching": True},
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, bundled_tokenizer):
    folder = build_tiny_qwen3_vl(tmp_path_factory.mktemp("qwen3_vl"), bundled_tokenizer)
    processor, hf = hf_processor(folder), hf_qwen3_vl(folder)
    inputs = [hf_inputs(processor, c) for c in CONVERSATIONS]
    return folder, inputs, [hf_greedy(hf, i, MAX_NEW) for i in inputs]


def test_prompt_and_pixels_equal_transformers_processor(tiny):
    folder, inputs, _ = tiny
    llm = LLM(str(folder), dtype="float32", num_kv_blocks=64)
    for conv, ref in zip(CONVERSATIONS, inputs):
        ids, images = llm.input.chat_prompt(conv, add_generation_prompt=True)
        assert ids == ref["input_ids"][0].tolist()
        if images:
            assert np.array_equal(np.concatenate([im.pixels for im in images]), ref["pixel_values"].numpy())
            assert [im.grid for im in images] == [tuple(g) for g in ref["image_grid_thw"].tolist()]


@pytest.mark.parametrize("config", list(CONFIGS))
def test_matches_hf(tiny, config):
    folder, _, reference = tiny
    llm = LLM(str(folder), dtype="float32", **CONFIGS[config])
    assert_matches_hf(llm, CONVERSATIONS, reference, MAX_NEW, "num_kv_blocks" in CONFIGS[config], chat=True)


def test_a_repeated_image_hits_the_prefix_cache_and_skips_the_encoder(tiny):
    folder, _, _ = tiny
    llm = LLM(str(folder), dtype="float32")
    encoder = llm.engine.model_runner.vision.cache
    image = picture(256, 160, 3)  # 40 tokens
    first = llm.chat(conversation("What is in the picture?", [image]), SamplingParams(max_tokens=2))[0]
    assert first.num_cached_tokens == 0 and encoder.num_encoded == 1
    # The image's last tokens share a block with the new question: their embeddings and
    # DeepStack levels come from the encoder cache.
    again = llm.chat(conversation("What colour is it?", [image]), SamplingParams(max_tokens=2))[0]
    common = next(i for i, (a, b) in enumerate(zip(first.prompt_token_ids, again.prompt_token_ids)) if a != b)
    assert again.num_cached_tokens == common // 16 * 16 > 16 and encoder.num_encoded == 1
    changed = np.asarray(image).copy()
    changed[0, 0, 0] ^= 0xFF
    llm.chat(conversation("What colour is it?", [Image.fromarray(changed)]), SamplingParams(max_tokens=2))
    assert encoder.num_encoded == 2
    assert_no_leak(llm)
