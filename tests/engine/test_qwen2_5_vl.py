"""Qwen2.5-VL end to end in the offline `LLM` against HF transformers, greedy, in float32: a
tiny random-weight model with a real vision tower, conversations with 0, 1 and 3 images of
different sizes and aspect ratios, batched with text-only ones, under chunked prefill that
splits images, prefix caching (a repeated image hits and skips the encoder, a changed pixel
misses) and preemption. The prompt and pixels our frontend makes equal transformers'
processor's exactly."""

from __future__ import annotations

import re

import numpy as np
import pytest
from PIL import Image

from helpers import assert_matches_hf, assert_no_leak, check_outputs_match
from pagedserve import LLM, SamplingParams
from vl_models import IMAGES, build_tiny_qwen2_5_vl, conversation, hf_greedy, hf_inputs, hf_processor, hf_qwen2_5_vl

pytestmark = pytest.mark.heavy(60)

MAX_NEW = 10
CONFIGS = {
    "batched": {},
    # 16-token chunks: every image (16 to 56 tokens) is split across steps
    "chunked": dict(max_num_batched_tokens=16, enable_prefix_caching=False),
    "preempted": dict(num_kv_blocks=8, enable_prefix_caching=False),
    "all_at_once": dict(num_kv_blocks=10, max_num_batched_tokens=24, enable_prefix_caching=True),
}


CONVERSATIONS = [
    conversation("Describe the picture.", IMAGES[:1]),
    conversation("What is the same in these?", IMAGES),
    conversation("Hello there, how are you today?", []),
    conversation("And this one?", IMAGES[1:2]),
    [{"role": "user", "content": [{"type": "text", "text": "First"}, {"type": "image", "image": IMAGES[2]},
                                  {"type": "text", "text": "then"}, {"type": "image", "image": IMAGES[0]}]}],
]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, bundled_tokenizer):
    folder = build_tiny_qwen2_5_vl(tmp_path_factory.mktemp("qwen2_5_vl"), bundled_tokenizer)
    processor, hf = hf_processor(folder), hf_qwen2_5_vl(folder)
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
    cache = llm.engine.model_runner.vision.cache
    assert 0 < cache.num_bytes <= cache.max_bytes


def test_a_repeated_image_hits_the_prefix_cache_and_skips_the_encoder(tiny):
    folder, _, _ = tiny
    llm = LLM(str(folder), dtype="float32")
    encoder = llm.engine.model_runner.vision.cache
    question = [IMAGES[2]]
    first = llm.chat(conversation("What is in the picture?", question), SamplingParams(max_tokens=2))[0]
    assert first.num_cached_tokens == 0 and encoder.num_encoded == 1
    # The same image, a new question: every full block before the question comes from the
    # prefix cache; the image's last tokens share a block with the question, and take their
    # embeddings from the encoder cache.
    again = llm.chat(conversation("What colour is it?", question), SamplingParams(max_tokens=2))[0]
    common = next(i for i, (a, b) in enumerate(zip(first.prompt_token_ids, again.prompt_token_ids)) if a != b)
    assert again.num_cached_tokens == common // 16 * 16 > 16 and encoder.num_encoded == 1
    # One changed pixel: the block where the image starts and all after it miss.
    changed = np.asarray(IMAGES[2]).copy()
    changed[0, 0, 0] ^= 0xFF
    other = llm.chat(conversation("What colour is it?", [Image.fromarray(changed)]), SamplingParams(max_tokens=2))[0]
    first_image_token = again.prompt_token_ids.index(llm.engine.model_runner.model.image_token_id)
    assert other.num_cached_tokens <= first_image_token and encoder.num_encoded == 2
    assert_no_leak(llm)


def test_a_request_over_the_pixel_budget_is_refused(tiny, monkeypatch):
    from common.errors import InvalidRequest
    from frontend.multimodal import processor
    folder, _, _ = tiny
    llm = LLM(str(folder), dtype="float32", num_kv_blocks=64)
    _, [one] = llm.input.chat_prompt(CONVERSATIONS[0])
    monkeypatch.setattr(processor, "MAX_PIXEL_BYTES", one.pixels.nbytes)
    llm.input.chat_prompt(CONVERSATIONS[0])  # exactly the budget
    with pytest.raises(InvalidRequest, match="MiB of pixels for the model, more than the 0 MiB a request may carry"):
        llm.input.chat_prompt(CONVERSATIONS[1])


def test_images_to_a_text_model_and_bad_image_counts_are_refused(tiny, bundled_path):
    from common.errors import InvalidRequest
    folder, _, _ = tiny
    llm = LLM(str(folder), dtype="float32", num_kv_blocks=64)
    with pytest.raises(InvalidRequest, match="1 image\\(s\\) for 2 image placeholder"):
        llm.generate({"prompt": "<|vision_start|><|image_pad|><|vision_end|>" * 2,
                      "multi_modal_data": {"image": IMAGES[0]}})
    text_llm = LLM(str(bundled_path), num_kv_blocks=64)
    with pytest.raises(InvalidRequest, match="takes text only"):
        text_llm.chat(conversation("Hi", IMAGES[:1]))
    assert_no_leak(llm)


def test_speculation_and_forks_with_images(tiny):
    """Verification rows after an image (M-RoPE positions past the prompt) and n=2 siblings
    (which keep the request's positions): an oracle drafts HF's answer, every draft verified."""
    from helpers import Oracle
    folder, _, reference = tiny
    llm = LLM(str(folder), dtype="float32", speculative_method="ngram", num_speculative_tokens=3)
    prompts = [llm.input.chat_prompt(c, add_generation_prompt=True)[0] for c in CONVERSATIONS]
    llm.engine.speculator.proposer = Oracle({tuple(p): r[0] for p, r in zip(prompts, reference)})
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, min_tokens=MAX_NEW, n=2)
    for out, (tokens, _) in zip(llm.chat(CONVERSATIONS, params), reference):
        assert [c.token_ids for c in out.outputs] == [tokens, tokens]
    assert llm.engine.stats().spec_decoding.num_accepted_tokens > 0
    assert_no_leak(llm)


def test_structured_output_with_an_image(tiny):
    from common.structured_output.params import StructuredOutputsParams
    folder, _, _ = tiny
    llm = LLM(str(folder), dtype="float32")
    pattern = "[0-9]{3}-[a-z]+"
    params = SamplingParams(temperature=0, max_tokens=12, structured_outputs=StructuredOutputsParams(regex=pattern))
    text = llm.chat(CONVERSATIONS[:2], params)[1].outputs[0].text
    assert re.fullmatch(pattern, text), text
    assert_no_leak(llm)


def test_lora_on_the_language_model_with_images(tiny, tmp_path):
    """A PEFT adapter on the language model's q/v projections (the vision tower's are named
    qkv: untouched) gives HF's merged model's answer, images and all."""
    from bench.lora_adapters import save_random_adapter
    folder, inputs, _ = tiny
    adapter = save_random_adapter(hf_qwen2_5_vl(folder), tmp_path / "vl_lora", 8, ["q_proj", "v_proj"], seed=3)
    hf = _merged_vl(folder, adapter)
    expected = [hf_greedy(hf, i, MAX_NEW) for i in inputs[:2]]
    llm = LLM(str(folder), dtype="float32", enable_lora=True, max_lora_rank=8)
    llm.load_lora("vl", str(adapter))
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, min_tokens=MAX_NEW, logprobs=5)
    outs = llm.chat(CONVERSATIONS[:2], params, lora_name="vl")
    assert check_outputs_match([(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs], expected) <= 1
    assert_no_leak(llm)


def _merged_vl(folder, adapter):
    from peft import PeftModel
    return PeftModel.from_pretrained(hf_qwen2_5_vl(folder), str(adapter)).merge_and_unload()
