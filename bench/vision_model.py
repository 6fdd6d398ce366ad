"""The model bench/vision.py measures: Qwen2.5-VL-3B's widths with few layers and random
weights, its real image preprocessing, and HF transformers' model and processor of it.

Qwen2.5-VL-3B-Instruct's config: vision tower hidden 1280, 16 heads, MLP 3420, patches of 14
pixels, 2x2 merged into one token of 2048, windows of 112 pixels, full attention in every 8th
block; language model hidden 2048, 16 heads, 2 KV heads, MLP 11008, M-RoPE sections
[16, 24, 24], tied embeddings. Here the tower has --vision-depth blocks (the last one full
attention) and the language model --text-layers layers; the vocabulary is the bundled
SmolLM2 tokenizer's plus Qwen's four vision tokens. The preprocessor is the Hub's
(min_pixels 3136, max_pixels 12845056: a 1024x1024 image makes 74x74 patches, 1369 tokens).
Made once in bfloat16 (as Qwen ships it), cached under ~/.cache/pagedserve.
"""

from __future__ import annotations

from pathlib import Path

VISION = {"hidden_size": 1280, "num_heads": 16, "intermediate_size": 3420, "out_hidden_size": 2048,
          "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2, "window_size": 112,
          "in_channels": 3, "hidden_act": "silu", "tokens_per_second": 2}
TEXT = {"hidden_size": 2048, "intermediate_size": 11008, "num_attention_heads": 16, "num_key_value_heads": 2,
        "max_position_embeddings": 32768, "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [16, 24, 24]}}
# The Hub's preprocessor_config.json of Qwen/Qwen2.5-VL-3B-Instruct.
PREPROCESSOR = {"min_pixels": 3136, "max_pixels": 12845056, "patch_size": 14, "temporal_patch_size": 2,
                "merge_size": 2, "image_mean": [0.48145466, 0.4578275, 0.40821073],
                "image_std": [0.26862954, 0.26130258, 0.27577711], "do_resize": True, "resample": 3}
MAX_MODEL_LEN = 4096  # a 1024x1024 image's 1369 tokens and a question, with room
QUESTIONS = ("What is in this picture?", "Which colour covers most of it?")  # the first, then the hit's
VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
# Qwen2.5-VL-*-Instruct's chat_template.json (images only): an image part renders as
# <|vision_start|><|image_pad|><|vision_end|>, which the processor widens to one pad per token.
CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build(vision_depth: int, text_layers: int) -> Path:
    """The random-weight model folder (cached by depth and layers)."""
    from common.paths import cache_dir
    folder = cache_dir() / "bench-vision" / f"qwen2.5-vl-3b-width-v{vision_depth}-l{text_layers}"
    if not (folder / "config.json").is_file():
        staging = folder.with_name(folder.name + ".staging")
        _write(staging, vision_depth, text_layers)
        staging.rename(folder)
    return folder


def _write(folder: Path, vision_depth: int, text_layers: int) -> None:
    import shutil

    import torch
    import transformers

    from engine.models.loader import load_tokenizer
    from engine.models.source import bundled_model_path
    shutil.rmtree(folder, ignore_errors=True)  # left by a run killed mid-write
    folder.mkdir(parents=True)
    load_tokenizer(bundled_model_path()).save_pretrained(str(folder))
    tok = transformers.AutoTokenizer.from_pretrained(str(folder))
    tok.add_tokens(list(VISION_TOKENS), special_tokens=True)
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(str(folder))
    ids = dict(zip(VISION_TOKENS, tok.convert_tokens_to_ids(list(VISION_TOKENS))))
    token_ids = {"bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id}
    text = {**TEXT, "num_hidden_layers": text_layers, "vocab_size": -(-len(tok) // 64) * 64, **token_ids}
    vision = {**VISION, "depth": vision_depth, "fullatt_block_indexes": [vision_depth - 1]}
    config = transformers.Qwen2_5_VLConfig(
        text_config=text, vision_config=vision, tie_word_embeddings=True, image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"], **token_ids)
    torch.manual_seed(0)
    model = transformers.Qwen2_5_VLForConditionalGeneration(config).eval()
    with torch.no_grad():  # HF starts biases at 0 and norms at 1: give them values that a bad load shows
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0.0, 0.02)
            elif "norm" in name or "ln_q" in name:
                p.normal_(1.0, 0.1)
    model.to(torch.bfloat16).save_pretrained(str(folder))
    image_processor_class()(**PREPROCESSOR).save_pretrained(str(folder))


def image_processor_class() -> type:
    """transformers' PIL Qwen2-VL image processor (the one the frontend runs)."""
    import transformers.models.qwen2_vl.image_processing_pil_qwen2_vl as pil_processing
    return pil_processing.Qwen2VLImageProcessorPil


def hf_model(folder: Path, dtype: str):
    """HF's Qwen2_5_VLForConditionalGeneration of the folder in `dtype`, eval mode."""
    import torch
    from transformers import Qwen2_5_VLForConditionalGeneration
    return Qwen2_5_VLForConditionalGeneration.from_pretrained(str(folder), dtype=getattr(torch, dtype)).eval()


def hf_processor(folder: Path):
    """transformers' Qwen2_5_VLProcessor over its PIL image processor. Its constructor checks
    each part's class, the video processor's too, which needs torchvision (not installed, and
    no video here): that check is skipped."""
    import json
    from unittest import mock

    from transformers import AutoTokenizer, ProcessorMixin, Qwen2_5_VLProcessor
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    image_processor = image_processor_class().from_dict(json.loads((folder / "preprocessor_config.json").read_text()))
    with mock.patch.object(ProcessorMixin, "check_argument_for_proper_class", lambda *args: None):
        return Qwen2_5_VLProcessor(image_processor=image_processor, tokenizer=tokenizer,
                                   chat_template=tokenizer.chat_template)


def hf_inputs(processor, image, question: str) -> dict:
    """HF's model inputs of one user turn: the image, then the question."""
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]
    text = processor.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return processor(text=[text], images=[image], return_tensors="pt")


def picture(size: int, seed: int):
    """A smooth random size x size RGB picture (random 8x8 colours, bicubic), one per seed."""
    import numpy as np
    from PIL import Image
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)).resize((size, size), Image.BICUBIC)


def conversation(image, question: str) -> list[dict]:
    """The same turn for pagedserve's `LLM.chat`."""
    return [{"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": question}]}]
