"""A tiny random-weight Gemma 3 vision-language model (HF's Gemma3ForConditionalGeneration)
for the image tests: the language model at test_gemma3's tiny size, a 2-layer SigLIP encoder
over 56x56 images (a 4x4 patch grid, pooled to 2x2 = 4 tokens per image), a tokenizer with
Gemma 3's image tokens, and Gemma 3's image processor config."""

from __future__ import annotations

import json
from pathlib import Path

import torch

IMAGE_SIZE = 56
PATCH_SIZE = 14
MM_TOKENS_PER_IMAGE = 4  # a square whose side (2) divides the 4-patch side: HF's avg pool
WINDOW = 16
# Gemma 3's tokenizer names them so; its processor reads the attributes.
IMAGE_TOKENS = {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"}


def tiny_gemma3_vl_config(vocab_size: int, image_ids: dict[str, int], **overrides):
    """test_gemma3's tiny text model (3 layers, local/local/global, query_pre_attn_scalar !=
    head_dim, linear rope scaling on the global layer), tied, with a tiny SigLIP."""
    from transformers import Gemma3Config
    text = {
        "model_type": "gemma3_text", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 3,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "max_position_embeddings": 512,
        "vocab_size": vocab_size, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
        "query_pre_attn_scalar": 24, "sliding_window": WINDOW,
        "layer_types": ["sliding_attention", "sliding_attention", "full_attention"],
        "rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1_000_000.0},
                            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}}}
    vision = {"model_type": "siglip_vision_model", "hidden_size": 32, "intermediate_size": 64,
              "num_hidden_layers": 2, "num_attention_heads": 2, "image_size": IMAGE_SIZE, "patch_size": PATCH_SIZE,
              "vision_use_head": False, "hidden_act": "gelu_pytorch_tanh", "layer_norm_eps": 1e-6}
    top = {"mm_tokens_per_image": MM_TOKENS_PER_IMAGE, "image_token_index": image_ids["image_token"],
           "boi_token_index": image_ids["boi_token"], "eoi_token_index": image_ids["eoi_token"],
           "initializer_range": 0.2}
    return Gemma3Config(text_config=text, vision_config=vision, **{**top, **overrides})


def build_tiny_gemma3_vl(folder: Path, tokenizer, **overrides) -> Path:
    """Save the tiny model (float32), `tokenizer` with the image tokens added (the text
    vocabulary covers them), preprocessor_config.json and processor_config.json into `folder`."""
    from transformers import AutoTokenizer, Gemma3ForConditionalGeneration
    folder = Path(folder)
    tokenizer.save_pretrained(str(folder))  # a copy: the caller's tokenizer stays as it was
    from engine.models.gemma3 import CHAT_TEMPLATE
    tok = AutoTokenizer.from_pretrained(str(folder), extra_special_tokens=IMAGE_TOKENS)
    tok.chat_template = CHAT_TEMPLATE  # Gemma 3's, which renders image parts
    tok.save_pretrained(str(folder))
    image_ids = {key: tok.convert_tokens_to_ids(token) for key, token in IMAGE_TOKENS.items()}
    torch.manual_seed(0)
    hf = Gemma3ForConditionalGeneration(tiny_gemma3_vl_config(len(tok), image_ids, **overrides)).eval()
    with torch.no_grad():  # HF starts norms, biases and the projection at 0 (or 1): make them matter
        for name, p in hf.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.3)
            elif "mm_input_projection_weight" in name:
                p.normal_(0, 0.2)
    hf.save_pretrained(str(folder), safe_serialization=True)
    (folder / "preprocessor_config.json").write_text(json.dumps(_preprocessor_config(), indent=2))
    (folder / "processor_config.json").write_text(json.dumps(
        {"image_seq_length": MM_TOKENS_PER_IMAGE, "processor_class": "Gemma3Processor"}, indent=2))
    return folder


def _preprocessor_config() -> dict:
    """Gemma 3's own (google/gemma-3-4b-it), at the tiny image size."""
    return {
        "image_processor_type": "Gemma3ImageProcessor", "processor_class": "Gemma3Processor",
        "do_convert_rgb": None, "do_normalize": True, "do_pan_and_scan": False, "do_rescale": True,
        "do_resize": True, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
        "image_seq_length": MM_TOKENS_PER_IMAGE, "pan_and_scan_max_num_crops": None,
        "pan_and_scan_min_crop_size": None, "pan_and_scan_min_ratio_to_activate": None, "resample": 2,
        "rescale_factor": 1 / 255, "size": {"height": IMAGE_SIZE, "width": IMAGE_SIZE},
    }
