"""Gemma 3's vision side against HF transformers in float32, on the tiny random model of
tests/vl_gemma3.py: our SigLIP encoder and projector equal HF's get_image_features for one
and three images (preprocessed by transformers' own Gemma 3 image processor); the config
reads; loading takes every checkpoint tensor; a prefill with image rows equals HF's causal
forward (image features put in after the embedding scale)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from vl_gemma3 import IMAGE_SIZE, MM_TOKENS_PER_IMAGE, WINDOW, build_tiny_gemma3_vl


@pytest.fixture(scope="module")
def folder(tmp_path_factory, bundled_tokenizer):
    return build_tiny_gemma3_vl(tmp_path_factory.mktemp("gemma3_vl"), bundled_tokenizer)


@pytest.fixture(scope="module")
def hf(folder):
    from transformers import Gemma3ForConditionalGeneration
    return Gemma3ForConditionalGeneration.from_pretrained(str(folder), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def ours(folder):
    from engine.models.loader import load_model, read_arch_config
    return load_model(folder, read_arch_config(folder), "float32", "cpu", max_positions=512)


def preprocess(folder, num_images: int) -> torch.Tensor:
    """Random RGB images of assorted sizes through the folder's Gemma3ImageProcessor."""
    from PIL import Image
    from transformers import AutoImageProcessor
    rng = np.random.default_rng(num_images)
    images = [Image.fromarray(rng.integers(0, 256, (30 + 17 * i, 80 - 9 * i, 3), dtype=np.uint8))
              for i in range(num_images)]
    return AutoImageProcessor.from_pretrained(str(folder))(images=images, return_tensors="pt")["pixel_values"]


def test_config_reads_the_vision_side(folder):
    from engine.models.loader import read_arch_config
    cfg = read_arch_config(folder)
    assert cfg.model_type == "gemma3" and cfg.tie_word_embeddings and cfg.qk_norm
    assert cfg.layer_types == ("sliding_attention", "sliding_attention", "full_attention")
    assert [cfg.layer_window(i) for i in range(3)] == [WINDOW, WINDOW, None]
    assert (cfg.rope_theta, cfg.rope_local_theta, cfg.query_pre_attn_scalar) == (1e6, 1e4, 24.0)
    v = cfg.vision
    assert (v["hidden_size"], v["num_layers"], v["num_heads"], v["image_size"], v["patch_size"]) == (32, 2, 2, 56, 14)
    assert v["mm_tokens_per_image"] == MM_TOKENS_PER_IMAGE and v["gelu_tanh"]
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(folder))
    ids = tok.convert_tokens_to_ids(["<start_of_image>", "<end_of_image>", "<image_soft_token>"])
    assert ids == [v["boi_token_id"], v["eoi_token_id"], v["image_token_id"]]
    assert cfg.vocab_size == len(tok)


def test_load_model_takes_every_tensor(folder, ours):
    """Every parameter equals its checkpoint tensors (fused ones: their parts in order)."""
    from safetensors import safe_open

    from engine.models.gemma3_vl import Gemma3ForConditionalGeneration, _our_name
    from engine.models.llama import _fused_name
    assert isinstance(ours, Gemma3ForConditionalGeneration)
    stacked: dict[str, dict[int, torch.Tensor]] = {}
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        for name in f.keys():  # noqa: SIM118 (safe_open is no dict)
            fused, index = _fused_name(_our_name(name))
            stacked.setdefault(fused, {})[index or 0] = f.get_tensor(name)
    params = dict(ours.named_parameters())
    assert set(stacked) == set(params) and any(n.startswith("vision_tower.") for n in params)
    for name, parts in stacked.items():
        assert torch.equal(params[name], torch.cat([parts[i] for i in sorted(parts)])), name
    assert ours.vision_tower.embeddings.patch_embedding.weight.dtype == torch.float32


@pytest.mark.parametrize("num_images", [1, 3])
def test_embed_images_equals_hf(folder, hf, ours, num_images):
    pixels = preprocess(folder, num_images)
    assert pixels.shape == (num_images, 3, IMAGE_SIZE, IMAGE_SIZE)
    with torch.no_grad():
        expected = hf.get_image_features(pixel_values=pixels).pooler_output
    got = ours.embed_images(list(pixels), [None] * num_images)
    assert len(got) == num_images
    for i, embeds in enumerate(got):
        assert embeds.shape == (MM_TOKENS_PER_IMAGE, 64)
        torch.testing.assert_close(embeds, expected[i], rtol=1e-5, atol=1e-5)
    assert expected.abs().mean() > 0.1  # the comparison is not of zeros


def test_prefill_with_image_rows_equals_hf(folder, hf, ours):
    """One prompt with an image, causal on both sides (HF without token_type_ids)."""
    from engine.attention import AttentionMetadata, PrefillChunk
    from engine.attention.torch_backend import TorchAttentionBackend
    from engine.models.llama import ForwardContext
    from engine.models.multimodal import MultiModalStep
    v = ours.config.vision
    ids = [1, 17, 40, v["boi_token_id"], *[v["image_token_id"]] * MM_TOKENS_PER_IMAGE, v["eoi_token_id"], 99, 5]
    input_ids = torch.tensor(ids)
    pixels = preprocess(folder, 1)
    with torch.no_grad():
        expected = hf(input_ids=input_ids[None], pixel_values=pixels).logits[0]
    rows = (input_ids == v["image_token_id"]).nonzero().flatten()
    embeds = ours.embed_images(list(pixels), [None])[0]
    cfg, block_size, n = ours.config, 16, len(ids)
    backend = TorchAttentionBackend(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
    caches = [torch.zeros(backend.kv_cache_shape(1, block_size)) for _ in range(cfg.num_layers)]
    meta = AttentionMetadata(slot_mapping=torch.arange(n), num_decode_tokens=0, decode_block_tables=None,
                             decode_context_lens=None, prefills=[PrefillChunk(0, n, n, torch.tensor([0]))],
                             backend_state={"block_size": block_size})
    backend.prepare(meta)
    ctx = ForwardContext(backend, meta, caches, MultiModalStep(rows, embeds))
    with torch.no_grad():
        logits = ours.compute_logits(ours(input_ids, torch.arange(n), ctx))
    torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)


def test_transformers_module_layout_loads_the_same(folder, ours, tmp_path):
    """The checkpoint under transformers' module names (model.language_model.*,
    model.vision_tower.vision_model.*, model.multi_modal_projector.*) loads to the same weights."""
    import shutil

    from safetensors.torch import load_file, save_file

    from engine.models.loader import load_model, read_arch_config
    renames = {"language_model.model.": "model.language_model.", "vision_tower.": "model.vision_tower.vision_model.",
               "multi_modal_projector.": "model.multi_modal_projector."}
    tensors = load_file(str(folder / "model.safetensors"))
    renamed = {next(new + n[len(old):] for old, new in renames.items() if n.startswith(old)): t
               for n, t in tensors.items()}
    save_file(renamed, str(tmp_path / "model.safetensors"))
    shutil.copy(folder / "config.json", tmp_path / "config.json")
    model = load_model(tmp_path, read_arch_config(tmp_path), "float32", "cpu", max_positions=512)
    theirs = dict(model.named_parameters())
    assert all(torch.equal(p, theirs[n]) for n, p in ours.named_parameters())


def test_tokens_per_image_must_pool_the_patch_grid():
    from vl_gemma3 import tiny_gemma3_vl_config

    from engine.models.config import ModelArchConfig
    ids = {"boi_token": 3, "eoi_token": 4, "image_token": 5}
    with pytest.raises(ValueError, match="mm_tokens_per_image 9 must be a square whose side divides the 4-patch"):
        ModelArchConfig.from_hf(tiny_gemma3_vl_config(512, ids, mm_tokens_per_image=9))
