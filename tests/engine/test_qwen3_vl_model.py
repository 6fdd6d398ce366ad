"""Qwen3-VL's model code against HF transformers in float32, on a tiny random-weight model
(tests/vl_models.py) and three images of different sizes and shapes, preprocessed by
transformers' own image processor: the vision tower's embeddings and DeepStack features (one
image at a time and all at once), the interleaved M-RoPE table, the positions of prompts with
0, 1 and 3 images, and a whole prefill's logits through the paged KV cache. Also: the config's
fields (as transformers 5 writes them and as the Hub's configs hold them), and both checkpoint
name layouts."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import vl_models
from test_qwen2_5_vl_model import (
    load_ours,
    per_image,
    prefill,
    prompt_ids,
    tensor_names,
)

import cpu_kernels
from engine.layers.rotary import MRotaryEmbedding
from engine.models.loader import read_arch_config
from engine.models.multimodal import MultiModalStep

IMAGE_SIZES = [(100, 150), (200, 90), (64, 64)]  # (height, width): wide, tall, square (the smallest grid)
HIDDEN = 64
LEVELS = 2  # DeepStack's


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, bundled_tokenizer):
    return vl_models.build_tiny_qwen3_vl(tmp_path_factory.mktemp("qwen3_vl"), bundled_tokenizer)


@pytest.fixture(scope="module")
def hf(tiny):
    return vl_models.hf_qwen3_vl(tiny)


@pytest.fixture(scope="module")
def images(tiny):
    """transformers' preprocessing of the three images: (pixel_values, image_grid_thw)."""
    from PIL import Image
    rng = np.random.default_rng(0)
    pictures = [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in IMAGE_SIZES]
    out = vl_models.qwen_vl_image_processor(tiny)(images=pictures, return_tensors="pt")
    return out["pixel_values"], out["image_grid_thw"]


@pytest.fixture(scope="module")
def ours(tiny):
    return load_ours(tiny)


def test_config_reads_text_and_vision_fields(tiny):
    cfg = read_arch_config(tiny)
    assert cfg.model_type == "qwen3_vl" and cfg.qk_norm and not cfg.qkv_bias and not cfg.tie_word_embeddings
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.num_layers) == (64, 128, 3)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (4, 2, 32)  # head_dim as the config says
    assert (cfg.rope_theta, cfg.rope_scaling, cfg.sliding_window) == (10000.0, None, None)
    v = cfg.vision
    assert v["mrope_section"] == (6, 5, 5) and v["deepstack_visual_indexes"] == (0, 1) and v["gelu_tanh"]
    assert (v["depth"], v["hidden_size"], v["num_heads"], v["patch_size"], v["num_position_embeddings"]) == (
        3, 32, 2, 16, 64)
    config = json.loads((tiny / "config.json").read_text())
    assert (v["image_token_id"], v["vision_start_token_id"]) == (config["image_token_id"],
                                                                 config["vision_start_token_id"])


def test_hub_config_layout_reads_the_same(tiny, tmp_path):
    """The Hub's Qwen3-VL config.json (transformers 4.57): M-RoPE in the text config's
    rope_scaling, rope_theta beside it, tie_word_embeddings in both, the vision config's
    model_type "qwen3_vl"."""
    config = json.loads((tiny / "config.json").read_text())
    text, vision = config["text_config"], config["vision_config"]
    rope = text.pop("rope_parameters")
    text.update(rope_theta=rope.pop("rope_theta"), rope_scaling=rope, tie_word_embeddings=False)
    vision.pop("rope_parameters")
    vision["model_type"] = "qwen3_vl"
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert read_arch_config(tmp_path) == read_arch_config(tiny)


def test_embed_images_match_hf_with_deepstack(hf, ours, images):
    pixels, grids = per_image(images)
    assert len(set(grids)) == 3
    with torch.no_grad():
        features = hf.model.get_image_features(*images)
    levels = [features.pooler_output, *features.deepstack_features]  # each: per image [tokens, 64]
    assert len(levels) == 1 + LEVELS
    together = ours.embed_images(pixels, grids)
    alone = [ours.embed_images([p], [g])[0] for p, g in zip(pixels, grids)]
    for i, g in enumerate(grids):
        for a in (together[i], alone[i]):
            assert a.shape == (int(np.prod(g)) // 4, HIDDEN * (1 + LEVELS))
            torch.testing.assert_close(a, torch.cat([level[i] for level in levels], dim=-1), rtol=1e-5, atol=5e-5)


def test_num_image_tokens_checks_the_pixels(ours, images):
    pixels, grids = per_image(images)
    assert pixels[0].shape[1] == 3 * 2 * 16 * 16
    assert ours.num_image_tokens(tuple(pixels[0].shape), grids[0]) == int(np.prod(grids[0])) // 4
    for shape, grid in [(pixels[0].shape, grids[1]), ((pixels[0].shape[0], 588), grids[0]), (pixels[0].shape, None)]:
        with pytest.raises(ValueError):
            ours.num_image_tokens(tuple(shape), grid)


def test_interleaved_mrope_table_matches_hf(hf, ours):
    """cos/sin at three different positions per token, as HF's Qwen3VLTextRotaryEmbedding (the
    sections interleave t h w t h w ...), which is not the sectioned layout of Qwen2.5-VL."""
    positions = torch.stack([torch.arange(0, 40), torch.arange(5, 45).flip(0), torch.arange(40) * 3 % 50])
    x = torch.zeros(1, dtype=torch.float32)
    cos, sin = hf.model.language_model.rotary_emb(x, positions[:, None])
    rope = ours.model.rotary(positions, torch.float32)
    torch.testing.assert_close(rope.gathered[0][:, 0], cos[0], rtol=0, atol=1e-6)
    torch.testing.assert_close(rope.gathered[1][:, 0], sin[0], rtol=0, atol=1e-6)
    sectioned = MRotaryEmbedding(32, 64, 10000.0, None, (6, 5, 5))(positions, torch.float32)
    assert not torch.allclose(sectioned.gathered[0], rope.gathered[0])


@pytest.mark.parametrize(("section", "head_dim"), [((24, 20, 20), 128), ((4, 6, 6), 32), ((8, 4, 4), 32)])
def test_interleaved_mrope_sections_match_hf(section, head_dim):
    """The Hub models' section, and sections whose interleaving runs past the head's pairs
    (HF's stops at them) or ends early (time takes the rest)."""
    from transformers import Qwen3VLTextConfig
    from transformers.models.qwen3_vl import modeling_qwen3_vl
    config = Qwen3VLTextConfig(head_dim=head_dim, rope_parameters={
        "rope_type": "default", "rope_theta": 10000.0, "mrope_section": list(section)})
    positions = torch.randint(0, 500, (3, 50), generator=torch.Generator().manual_seed(0))
    cos, sin = modeling_qwen3_vl.Qwen3VLTextRotaryEmbedding(config)(torch.zeros(1), positions[:, None])
    rope = MRotaryEmbedding(head_dim, 512, 10000.0, None, section, interleaved=True)(positions, torch.float32)
    assert torch.equal(rope.gathered[0][:, 0], cos[0]) and torch.equal(rope.gathered[1][:, 0], sin[0])


@pytest.mark.parametrize("num_images", [0, 1, 3])
def test_mrope_positions_match_hf(tiny, hf, ours, images, num_images):
    grids = per_image(images)[1][:num_images]
    ids = prompt_ids(tiny, grids)
    input_ids = torch.tensor([ids])
    image_types = (input_ids == ours.image_token_id).int()
    expected, delta = hf.model.get_rope_index(input_ids, image_types, image_grid_thw=images[1][:num_images])
    positions, our_delta = ours.mrope_positions(ids, grids)
    assert positions.dtype == np.int64 and np.array_equal(positions, expected[:, 0].numpy())
    assert our_delta == int(delta) and (our_delta < 0) == (num_images > 0)


@pytest.mark.parametrize("layer_kernels", [False, pytest.param(True, marks=pytest.mark.skipif(
    not cpu_kernels.available("layer_ops"), reason="CPU layer kernels unavailable"))])
def test_prefill_matches_hf(tiny, hf, ours, images, layer_kernels):
    """Three images in one prompt: every position's logits as HF's forward gives them; without
    the DeepStack levels (or the M-RoPE positions) they differ."""
    model = load_ours(tiny, layer_kernels=True) if layer_kernels else ours
    pixels, grids = per_image(images)
    ids = prompt_ids(tiny, grids)
    input_ids = torch.tensor([ids])
    is_image = input_ids == model.image_token_id
    with torch.no_grad():
        expected = hf(input_ids=input_ids, pixel_values=images[0], image_grid_thw=images[1],
                      mm_token_type_ids=is_image.int()).logits[0]
    positions = torch.from_numpy(model.mrope_positions(ids, grids)[0])
    step = MultiModalStep(is_image[0].nonzero().flatten(), torch.cat(model.embed_images(pixels, grids)), positions)
    logits = prefill(model, ids, step)
    torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)
    without_deepstack = MultiModalStep(step.rows, step.embeds[:, :HIDDEN], positions)
    for other in (without_deepstack, MultiModalStep(step.rows, step.embeds)):  # the latter: 1-D positions
        assert (prefill(model, ids, other)[-1] - logits[-1]).abs().max() > 1e-3


def test_text_prompt_matches_hf(tiny, hf, ours):
    """No image and no ctx.mm: plain positions, as HF's forward without mm_token_type_ids."""
    ids = prompt_ids(tiny, [])
    with torch.no_grad():
        expected = hf(input_ids=torch.tensor([ids])).logits[0]
    torch.testing.assert_close(prefill(ours, ids, None), expected, rtol=1e-4, atol=1e-4)


def test_older_name_layout_loads_the_same(tiny, ours, tmp_path):
    """The tiny folder has transformers 5's (and the Hub's Qwen3-VL) names, model.visual.* and
    model.language_model.*; the same tensors named as Qwen2.5-VL's Hub checkpoints (visual.*,
    model.*) load the same."""
    from safetensors.torch import load_file, save_file
    assert {"model.visual.pos_embed.weight", "model.language_model.norm.weight"} <= tensor_names(tiny)
    folder = tmp_path / "older_layout"
    folder.mkdir()
    for path in tiny.iterdir():
        if path.suffix != ".safetensors":
            (folder / path.name).write_bytes(path.read_bytes())
    tensors = {name.replace("model.visual.", "visual.", 1).replace("model.language_model.", "model.", 1): t
               for name, t in load_file(str(tiny / "model.safetensors")).items()}
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    assert "visual.deepstack_merger_list.0.norm.weight" in tensor_names(folder)
    theirs = dict(load_ours(folder).named_parameters())
    assert all(torch.equal(p, theirs[name]) for name, p in ours.named_parameters())
