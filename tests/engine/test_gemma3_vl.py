"""Gemma 3 with images end to end in the offline `LLM` against HF transformers, greedy, in
float32: a tiny random-weight Gemma3ForConditionalGeneration (SigLIP encoder, projector, an
image's tokens attending to each other both ways, windowed layers), conversations with 0, 1
and 3 images, under batching, chunked prefill (which never splits an image), prefix caching
and preemption. The prompt and pixels our frontend makes equal transformers' processor's."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from common.multimodal import whole_image_end
from helpers import assert_matches_hf
from pagedserve import LLM, SamplingParams
from vl_gemma3 import build_tiny_gemma3_vl
from vl_models import IMAGES, conversation, hf_greedy, hf_inputs, hf_processor

pytestmark = pytest.mark.heavy(40)

MAX_NEW = 10
CONFIGS = {
    "batched": {},
    # 7-token chunks: every 4-token image (with its 2 + 2 boundary tokens) moves to a chunk of its own
    "chunked": dict(max_num_batched_tokens=7, enable_prefix_caching=False),
    "preempted": dict(num_kv_blocks=6, enable_prefix_caching=False),
    "all_at_once": dict(num_kv_blocks=7, max_num_batched_tokens=9, enable_prefix_caching=True),
}
CONVERSATIONS = [
    conversation("Describe the picture.", IMAGES[:1]),
    conversation("What is the same in these?", IMAGES),
    conversation("Hello there, how are you today?", []),
    [{"role": "user", "content": [{"type": "text", "text": "First"}, {"type": "image", "image": IMAGES[2]},
                                  {"type": "text", "text": "then"}, {"type": "image", "image": IMAGES[0]}]}],
]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, bundled_tokenizer):
    from transformers import Gemma3ForConditionalGeneration
    folder = build_tiny_gemma3_vl(tmp_path_factory.mktemp("gemma3_vl"), bundled_tokenizer)
    processor = hf_processor(folder)
    hf = Gemma3ForConditionalGeneration.from_pretrained(str(folder), dtype=torch.float32).eval()
    inputs = [hf_inputs(processor, c) for c in CONVERSATIONS]
    return folder, inputs, [hf_greedy(hf, i, MAX_NEW) for i in inputs]


def test_prompt_and_pixels_equal_transformers_processor(tiny):
    folder, inputs, _ = tiny
    llm = LLM(str(folder), dtype="float32", num_kv_blocks=64)
    for conv, ref in zip(CONVERSATIONS, inputs):
        ids, images = llm.input.chat_prompt(conv, add_generation_prompt=True)
        assert ids == ref["input_ids"][0].tolist()
        if images:
            assert np.array_equal(np.stack([im.pixels for im in images]), ref["pixel_values"].numpy())
            image_rows = ref["token_type_ids"][0].nonzero().flatten().tolist()
            assert [i for im in images for i in range(im.offset, im.end)] == image_rows


@pytest.mark.parametrize("config", list(CONFIGS))
def test_matches_hf(tiny, config):
    folder, _, reference = tiny
    llm = LLM(str(folder), dtype="float32", **CONFIGS[config])
    assert_matches_hf(llm, CONVERSATIONS, reference, MAX_NEW, "num_kv_blocks" in CONFIGS[config], chat=True)


def test_without_both_ways_attention_the_answer_differs(tiny, monkeypatch):
    """The bidirectional mask matters: causal attention over the image tokens changes the logits."""
    from engine.models import gemma3_vl
    folder, _, reference = tiny
    monkeypatch.setattr(gemma3_vl.Gemma3ForConditionalGeneration, "bidirectional_images", False)
    llm = LLM(str(folder), dtype="float32")
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, min_tokens=MAX_NEW, logprobs=5)
    out = llm.chat(CONVERSATIONS[:1], params)[0].outputs[0]
    assert out.logprobs[0] != pytest.approx(reference[0][1][0], abs=1e-4)


def test_a_chunk_never_ends_inside_an_image():
    from common.multimodal import ImageInput
    pixels = np.zeros(1, np.float32)
    images = [ImageInput(pixels, None, "a", 10, 4), ImageInput(pixels, None, "b", 20, 4)]
    assert whole_image_end(images, 0, 12) == 10  # cut before the image
    assert whole_image_end(images, 0, 14) == 14  # ends with it
    assert whole_image_end(images, 10, 12) == 10  # starts in it: nothing this step
    assert whole_image_end(images, 11, 16) == 16  # the rest of a cached image, whole
    assert whole_image_end(images, 14, 22) == 20


def test_a_step_budget_smaller_than_an_image_is_refused(tiny):
    folder, _, _ = tiny
    with pytest.raises(ValueError, match="max_num_batched_tokens 3: gemma3 prefills each image's 4 tokens"):
        LLM(str(folder), dtype="float32", max_num_batched_tokens=3)
