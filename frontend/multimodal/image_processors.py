"""Image preprocessing in the frontend by transformers' own PIL/numpy image processors
(`image_processing_pil_*`), configured from the model's preprocessor_config.json, without
torch.

The frontend never loads torch (a frontend process stays small and quick to start:
frontend/tokenizer.py). transformers' image modules import it wherever it is installed:
image_utils, image_transforms and image_processing_backends ask is_torch_available() when
they are imported, and utils.generic keeps the answer in a flag of its own. `without_torch`
tells them torch is absent before they load, in a process that has not loaded it; they then
take their numpy paths, which compute the same pixels (tests/unit/test_image_processors.py
compares the two, and checks that torch stays out). A process that has loaded torch already
(the offline `LLM`, whose engine runs in it) keeps transformers as it is.
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
from dataclasses import dataclass

import numpy as np

# model_type -> (module, class) of its PIL image processor
PROCESSORS = {
    "qwen2_vl": ("transformers.models.qwen2_vl.image_processing_pil_qwen2_vl", "Qwen2VLImageProcessorPil"),
    "qwen2_5_vl": ("transformers.models.qwen2_vl.image_processing_pil_qwen2_vl", "Qwen2VLImageProcessorPil"),
    "qwen3_vl": ("transformers.models.qwen2_vl.image_processing_pil_qwen2_vl", "Qwen2VLImageProcessorPil"),
    "gemma3": ("transformers.models.gemma3.image_processing_pil_gemma3", "Gemma3ImageProcessorPil"),
}

_NO_ADVICE = "TRANSFORMERS_NO_ADVISORY_WARNINGS"
log = logging.getLogger(__name__)


def without_torch() -> None:
    """Make transformers' image modules, imported after this, take their numpy paths: in a
    process without torch loaded, transformers is told torch is unavailable (see the top).
    Nothing where torch is loaded already."""
    if "torch" in sys.modules:
        return
    import transformers.utils as utils
    from transformers.utils import generic, import_utils

    def unavailable() -> bool:
        return False

    import_utils.is_torch_available = utils.is_torch_available = unavailable
    generic._is_torch_available = False


@dataclass
class ProcessedImage:
    """One image as the model's vision encoder takes it: `pixels` (float32; Qwen2-VL: [patches,
    C * temporal_patch * patch^2] rows; Gemma 3: [3, H, W]) and, where the family has one, its
    patch grid (t, h, w)."""

    pixels: np.ndarray
    grid: tuple[int, int, int] | None = None


class ImageProcessor:
    """The model family's transformers image processor, configured by the model's
    preprocessor_config.json (`config`, as read)."""

    def __init__(self, model_type: str, config: dict) -> None:
        if model_type not in PROCESSORS:
            raise ValueError(f"images: no image processor for {model_type!r} (known: {', '.join(PROCESSORS)})")
        without_torch()
        module, name = PROCESSORS[model_type]
        # transformers re-runs its __init__ while importing a model module, which then advises
        # "PyTorch was not found" in the frontend's log: not news here.
        previous = os.environ.get(_NO_ADVICE)
        os.environ[_NO_ADVICE] = "1"
        try:
            cls = getattr(importlib.import_module(module), name)
        finally:
            if previous is None:
                del os.environ[_NO_ADVICE]
            else:
                os.environ[_NO_ADVICE] = previous
        self.model_type = model_type
        if config.get("do_pan_and_scan"):  # crops of one image, each with its own placeholder: not taken yet
            log.warning("images: %s's do_pan_and_scan is turned off (transformers' default): each image is "
                        "read whole, at the model's size", model_type)
            config = {**config, "do_pan_and_scan": False}
        # from_dict reads the file as from_pretrained does, older key names included
        # (Qwen2.5-VL's min_pixels / max_pixels).
        self.processor = cls.from_dict(config)

    def __call__(self, images: list) -> list[ProcessedImage]:
        """PIL images -> one ProcessedImage each, as the processor computes them together."""
        if not images:
            return []
        out = self.processor(images=images, return_tensors="np")
        if "image_grid_thw" in out:  # Qwen2-VL: every image's patches, one after the other
            grids = [tuple(int(x) for x in g) for g in out["image_grid_thw"]]
            bounds = np.cumsum([0] + [t * h * w for t, h, w in grids])
            return [ProcessedImage(out["pixel_values"][a:b], g) for a, b, g in zip(bounds, bounds[1:], grids)]
        return [ProcessedImage(pixels) for pixels in out["pixel_values"]]
