"""Qwen2.5-VL's model code against HF transformers in float32, on a tiny random-weight model
(tests/vl_models.py) and three images of different sizes and shapes, preprocessed by
transformers' own image processor: the vision tower's embeddings (one image at a time and all
at once), the M-RoPE positions of prompts with 0, 1 and 3 images, and a whole prefill's logits
through the paged KV cache. Also: the config's fields, and both checkpoint name layouts."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import vl_models

import cpu_kernels
from engine.attention import AttentionMetadata, PrefillChunk
from engine.attention.torch_backend import TorchAttentionBackend
from engine.layers.rotary import MRotaryEmbedding
from engine.models.llama import ForwardContext
from engine.models.loader import load_model, read_arch_config
from engine.models.multimodal import MultiModalStep

IMAGE_SIZES = [(100, 150), (200, 90), (64, 64)]  # (height, width): wide, tall, square (the smallest grid)
BLOCK_SIZE = 16


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, bundled_tokenizer):
    return vl_models.build_tiny_qwen2_5_vl(tmp_path_factory.mktemp("qwen2_5_vl"), bundled_tokenizer)


@pytest.fixture(scope="module")
def hf(tiny):
    return vl_models.hf_qwen2_5_vl(tiny)


@pytest.fixture(scope="module")
def images(tiny):
    """transformers' preprocessing of the three images: (pixel_values, image_grid_thw)."""
    from PIL import Image
    rng = np.random.default_rng(0)
    pictures = [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in IMAGE_SIZES]
    out = vl_models.qwen_vl_image_processor(tiny)(images=pictures, return_tensors="pt")
    return out["pixel_values"], out["image_grid_thw"]


def load_ours(folder, layer_kernels: bool = False):
    return load_model(folder, read_arch_config(folder), "float32", "cpu", 2048, layer_kernels=layer_kernels)


@pytest.fixture(scope="module")
def ours(tiny):
    return load_ours(tiny)


def per_image(images) -> tuple[list[torch.Tensor], list[tuple[int, int, int]]]:
    pixels, grids = images
    grids = [tuple(g.tolist()) for g in grids]
    return list(pixels.split([int(np.prod(g)) for g in grids])), grids


def prompt_ids(folder, grids: list[tuple[int, int, int]]) -> list[int]:
    """The chat template's prompt with an image part per grid, each <|image_pad|> widened to
    the image's tokens (as HF's processor does)."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(folder))
    parts = [{"type": "text", "text": "Compare these."}]
    for i in range(len(grids)):
        parts[i:i] = [{"type": "image"}, {"type": "text", "text": f"Picture {i}:"}]
    text = tok.apply_chat_template([{"role": "user", "content": parts}], tokenize=False, add_generation_prompt=True)
    pad = tok.convert_tokens_to_ids("<|image_pad|>")
    ids, widths = [], iter(int(np.prod(g)) // 4 for g in grids)
    for t in tok.encode(text, add_special_tokens=False):
        ids += [pad] * next(widths) if t == pad else [t]
    return ids


def test_config_reads_text_and_vision_fields(tiny):
    cfg = read_arch_config(tiny)
    assert cfg.model_type == "qwen2_5_vl" and cfg.qkv_bias and not cfg.tie_word_embeddings
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.num_layers) == (64, 128, 2)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (4, 2, 16)
    assert (cfg.rope_theta, cfg.rope_scaling, cfg.sliding_window, cfg.vocab_size) == (10000.0, None, None, 49216)
    v = cfg.vision
    assert v["mrope_section"] == (2, 3, 3) and v["fullatt_block_indexes"] == (1,)
    assert (v["depth"], v["hidden_size"], v["num_heads"], v["window_size"], v["out_hidden_size"]) == (2, 32, 2, 56, 64)
    config = json.loads((tiny / "config.json").read_text())
    assert (v["image_token_id"], v["vision_start_token_id"]) == (config["image_token_id"],
                                                                 config["vision_start_token_id"])


def test_hub_config_layout_reads_the_same(tiny, tmp_path):
    """The Hub's Qwen2.5-VL config.json (transformers 4): the language model's fields at the
    top level, M-RoPE as rope_scaling {"type": "mrope"}, a sliding window that is off."""
    config = json.loads((tiny / "config.json").read_text())
    text = config.pop("text_config")
    rope = text.pop("rope_parameters")
    config.update(text, model_type="qwen2_5_vl", rope_theta=rope["rope_theta"], sliding_window=32768,
                  rope_scaling={"type": "mrope", "mrope_section": rope["mrope_section"]})
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert read_arch_config(tmp_path) == read_arch_config(tiny)


def test_embed_images_match_hf(hf, ours, images):
    pixels, grids = per_image(images)
    assert len(set(grids)) == 3
    with torch.no_grad():
        reference = hf.model.get_image_features(*images).pooler_output
    together = ours.embed_images(pixels, grids)
    alone = [ours.embed_images([p], [g])[0] for p, g in zip(pixels, grids)]
    for ref, a, b, g in zip(reference, together, alone, grids):
        assert a.shape == (int(np.prod(g)) // 4, 64)
        torch.testing.assert_close(a, ref, rtol=1e-5, atol=5e-5)
        torch.testing.assert_close(b, ref, rtol=1e-5, atol=5e-5)


def test_windows_matter(ours, images):
    """Block 0 attends within 2x2-token windows: the same blocks all attending globally differ."""
    pixels, grids = per_image(images)
    windowed = ours.embed_images(pixels[:1], grids[:1])[0]
    full = ours.visual.full_blocks
    ours.visual.full_blocks = {0, 1}
    try:
        assert (ours.embed_images(pixels[:1], grids[:1])[0] - windowed).abs().max() > 1e-3
    finally:
        ours.visual.full_blocks = full


def test_num_image_tokens_checks_the_pixels(ours, images):
    pixels, grids = per_image(images)
    assert ours.num_image_tokens(tuple(pixels[0].shape), grids[0]) == int(np.prod(grids[0])) // 4
    for shape, grid in [(pixels[0].shape, grids[1]), ((pixels[0].shape[0], 588), grids[0]), (pixels[0].shape, None)]:
        with pytest.raises(ValueError):
            ours.num_image_tokens(tuple(shape), grid)


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
    with pytest.raises(ValueError):
        ours.mrope_positions(ids, grids + [(1, 4, 4)])


def test_mrope_on_equal_rows_is_plain_rope():
    rotary = MRotaryEmbedding(16, 64, 10000.0, None, (2, 3, 3))
    positions = torch.tensor([0, 5, 9, 63])
    plain, mrope = rotary(positions, torch.float32), rotary(positions.expand(3, -1), torch.float32)
    assert all(torch.equal(a, b) for a, b in zip(plain.gathered, mrope.gathered))
    other = rotary(torch.stack([positions, positions.flip(0), positions]), torch.float32)
    assert not torch.equal(other.gathered[0], plain.gathered[0])


def prefill(model, ids: list[int], step: MultiModalStep) -> torch.Tensor:
    """Our logits of one whole-prompt prefill through the torch backend's paged cache."""
    cfg = model.config
    num = len(ids)
    backend = TorchAttentionBackend(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
    table = torch.randperm(-(-num // BLOCK_SIZE) + 3)[:-(-num // BLOCK_SIZE)]  # scattered blocks
    rows = torch.arange(num)
    meta = AttentionMetadata(slot_mapping=table[rows // BLOCK_SIZE] * BLOCK_SIZE + rows % BLOCK_SIZE,
                             num_decode_tokens=0, decode_block_tables=None, decode_context_lens=None,
                             prefills=[PrefillChunk(0, num, num, table)], backend_state={"block_size": BLOCK_SIZE})
    backend.prepare(meta)
    caches = [torch.zeros(backend.kv_cache_shape(len(table) + 3, BLOCK_SIZE)) for _ in range(cfg.num_layers)]
    with torch.no_grad():
        return model.compute_logits(model(torch.tensor(ids), rows, ForwardContext(backend, meta, caches, step)))


@pytest.mark.parametrize("layer_kernels", [False, pytest.param(True, marks=pytest.mark.skipif(
    not cpu_kernels.available("layer_ops"), reason="CPU layer kernels unavailable"))])
def test_prefill_matches_hf(tiny, hf, ours, images, layer_kernels):
    """Three images in one prompt: every position's logits as HF's forward gives them."""
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
    plain = prefill(model, ids, MultiModalStep(step.rows, step.embeds))  # the images at 1-D positions
    assert (logits[-1] - plain[-1]).abs().max() > 1e-3


def test_text_prompt_matches_hf(tiny, hf, ours):
    """No image and no ctx.mm: plain positions, as HF's forward without mm_token_type_ids."""
    ids = prompt_ids(tiny, [])
    with torch.no_grad():
        expected = hf(input_ids=torch.tensor([ids])).logits[0]
    torch.testing.assert_close(prefill(ours, ids, None), expected, rtol=1e-4, atol=1e-4)


def tensor_names(folder) -> set[str]:
    from safetensors import safe_open
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        return set(f.keys())


def test_module_layout_checkpoint_loads_the_same(tiny, ours, tmp_path):
    """The tiny folder has the Hub's names (visual.*, model.*); the same tensors named as
    transformers' module tree (model.visual.*, model.language_model.*) load the same."""
    assert "visual.merger.ln_q.weight" in tensor_names(tiny) and "model.norm.weight" in tensor_names(tiny)
    folder = vl_models.to_module_layout(tiny, tmp_path / "module_layout")
    assert {"model.visual.merger.ln_q.weight", "model.language_model.norm.weight"} <= tensor_names(folder)
    other = load_ours(folder)
    theirs = dict(other.named_parameters())
    assert all(torch.equal(p, theirs[name]) for name, p in ours.named_parameters())
