"""Issue 48's vision-language families on CUDA: the tiny random-weight Qwen2.5-VL, Qwen3-VL and
Gemma 3 of the CPU tests, greedy with 0, 1 and 3 images against HF transformers on the same
GPU, fp32. The vision towers, M-RoPE (Qwen) and the both-ways image attention (Gemma 3, which
runs the torch backend on CUDA) run on the device; the second run is served partly from the
prefix cache, images included."""

from __future__ import annotations

import pytest
import torch

from gpu_skip import pytestmark  # noqa: F401  (skips this module without a GPU)

MAX_NEW = 8


def builders():
    from vl_gemma3 import build_tiny_gemma3_vl
    from vl_models import build_tiny_qwen2_5_vl, build_tiny_qwen3_vl
    return {"qwen2_5_vl": build_tiny_qwen2_5_vl, "qwen3_vl": build_tiny_qwen3_vl, "gemma3": build_tiny_gemma3_vl}


def reference(folder, conversations: list[list[dict]], device: str) -> list[list[int]]:
    """HF's greedy tokens: its own processor's inputs, its model on `device`."""
    from transformers import AutoModelForImageTextToText
    from vl_models import hf_greedy, hf_inputs, hf_processor
    processor = hf_processor(folder)
    model = AutoModelForImageTextToText.from_pretrained(str(folder), dtype=torch.float32).to(device).eval()
    return [hf_greedy(model, hf_inputs(processor, c).to(device), MAX_NEW)[0] for c in conversations]


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl", "gemma3"])
def test_vision_family_matches_hf_on_cuda(family, tmp_path, bundled_tokenizer):
    from pagedserve import LLM, SamplingParams
    from vl_models import IMAGES, conversation
    folder = builders()[family](tmp_path, bundled_tokenizer)
    conversations = [conversation("Describe it.", IMAGES[:1]), conversation("Compare them.", IMAGES),
                     conversation("Hello there.", [])]
    expected = reference(folder, conversations, "cuda")
    llm = LLM(str(folder), device="cuda", dtype="float32", num_kv_blocks=256)
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, min_tokens=MAX_NEW)
    for _ in range(2):
        assert [o.outputs[0].token_ids for o in llm.chat(conversations, params)] == expected
    assert llm.engine.stats().num_prefix_cache_hits > 0
