"""frontend/multimodal/image_processors.py: the model's transformers image processor run
without torch (as in a frontend process) gives exactly the pixels and grids transformers
gives where torch is loaded (this test's process), split per image; and torch stays out."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from PIL import Image

from frontend.multimodal.image_processors import PROCESSORS, ImageProcessor

# As the models ship them: Qwen2.5-VL's (older key names) and Gemma 3 4B's.
CONFIGS = {
    "qwen2_5_vl": {"min_pixels": 3136, "max_pixels": 200704, "patch_size": 14, "temporal_patch_size": 2,
                   "merge_size": 2, "image_mean": [0.48145466, 0.4578275, 0.40821073],
                   "image_std": [0.26862954, 0.26130258, 0.27577711], "image_processor_type": "Qwen2VLImageProcessor",
                   "processor_class": "Qwen2_5_VLProcessor"},
    "gemma3": {"do_pan_and_scan": None, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
               "image_processor_type": "Gemma3ImageProcessor", "processor_class": "Gemma3Processor",
               "size": {"height": 896, "width": 896}, "resample": 2, "rescale_factor": 0.00392156862745098},
}
# Sizes and aspect ratios: tiny, wide, tall, large; RGBA and grayscale converted to RGB.
SHAPES = [((30, 40), "RGB"), ((300, 97), "RGB"), ((64, 900), "RGBA"), ((1000, 750), "L")]


def write_images(folder) -> list:
    """Random images of SHAPES as PNG files in `folder`, opened."""
    rng = np.random.RandomState(0)
    paths = []
    for i, ((h, w), mode) in enumerate(SHAPES):
        channels = {"RGB": 3, "RGBA": 4, "L": 1}[mode]
        array = (rng.rand(h, w, channels) * 255).astype(np.uint8)
        paths.append(folder / f"{i}.png")
        Image.fromarray(array.squeeze(-1) if channels == 1 else array, mode).save(paths[-1])
    return [Image.open(path) for path in paths]


def without_torch_in_a_subprocess(model_type: str, folder) -> list[dict]:
    """What the frontend computes: a fresh process that must never load torch."""
    script = f"""
import json, sys
import numpy as np
from PIL import Image
from frontend.multimodal.image_processors import ImageProcessor
images = [Image.open({str(folder)!r} + f"/{{i}}.png") for i in range({len(SHAPES)})]
processed = ImageProcessor({model_type!r}, {CONFIGS[model_type]!r})(images)
assert "torch" not in sys.modules, "torch was imported"
np.savez({str(folder / 'out.npz')!r}, *[p.pixels for p in processed])
print(json.dumps([p.grid for p in processed]))
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    arrays = np.load(folder / "out.npz")
    grids = json.loads(done.stdout.strip().splitlines()[-1])
    return [{"pixels": arrays[f"arr_{i}"], "grid": grid} for i, grid in enumerate(grids)]


@pytest.mark.parametrize("model_type", list(CONFIGS))
def test_pixels_equal_transformers_with_torch(model_type, tmp_path):
    import importlib
    images = write_images(tmp_path)
    ours = without_torch_in_a_subprocess(model_type, tmp_path)
    module, name = PROCESSORS[model_type]
    theirs = getattr(importlib.import_module(module), name).from_dict(CONFIGS[model_type])(
        images=images, return_tensors="np")
    if model_type == "gemma3":
        assert [p["grid"] for p in ours] == [None] * len(SHAPES)
        assert np.array_equal(np.stack([p["pixels"] for p in ours]), theirs["pixel_values"])
    else:
        assert [tuple(p["grid"]) for p in ours] == [tuple(g) for g in theirs["image_grid_thw"].tolist()]
        assert np.array_equal(np.concatenate([p["pixels"] for p in ours]), theirs["pixel_values"])
        assert len({p["pixels"].shape[0] for p in ours}) > 1  # sizes differ per image
    assert all(p["pixels"].dtype == np.float32 for p in ours)


def test_in_a_process_with_torch_it_is_transformers_as_it_is(tmp_path):
    processed = ImageProcessor("qwen2_5_vl", CONFIGS["qwen2_5_vl"])(write_images(tmp_path)[:1])
    t, h, w = processed[0].grid
    assert processed[0].pixels.shape == (t * h * w, 3 * 2 * 14 * 14)
    assert ImageProcessor("gemma3", CONFIGS["gemma3"])([]) == []


def test_a_family_without_a_processor_is_named():
    with pytest.raises(ValueError, match="no image processor for 'llama'"):
        ImageProcessor("llama", {})


def test_gemma3_pan_and_scan_is_turned_off(caplog):
    """Pan-and-scan would add crops, each with a placeholder of its own: one image stays one."""
    from PIL import Image

    from frontend.multimodal.image_processors import ImageProcessor
    config = {"image_processor_type": "Gemma3ImageProcessor", "do_pan_and_scan": True,
              "size": {"height": 56, "width": 56}, "pan_and_scan_min_crop_size": 16, "pan_and_scan_max_num_crops": 4,
              "pan_and_scan_min_ratio_to_activate": 1.2, "image_mean": [0.5] * 3, "image_std": [0.5] * 3,
              "rescale_factor": 1 / 255}
    [image] = ImageProcessor("gemma3", config)([Image.new("RGB", (400, 100))])
    assert image.pixels.shape == (3, 56, 56) and "do_pan_and_scan is turned off" in caplog.text
