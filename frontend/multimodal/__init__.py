"""Images in, text out: what the frontend does with an image before the engine sees it.

    parts.py             each API's image parts -> one normalized message form (ImageRef, then PIL images)
    fetch.py             http(s) image URLs, only from --allowed-media-domains, within limits
    images.py            decoding data URLs, base64 and bytes, header checked before pixels
    image_processors.py  the model family's transformers PIL image processor, without torch
    families.py          each family's placeholder and how an image's tokens expand
    processor.py         a prompt's images preprocessed, placeholders expanded, hashed (ImageInput)
"""

from __future__ import annotations

import argparse
import json

DEFAULT_MAX_IMAGES = 16  # per prompt, unless --limit-mm-per-prompt says


def image_limit(value: str) -> int:
    """--limit-mm-per-prompt as vLLM takes it: `image=N`, or JSON `{"image": N}`."""
    try:
        pairs = [] if value.strip().startswith("{") else [item.split("=", 1) for item in value.split(",")]
        limits = json.loads(value) if not pairs else {k.strip(): int(v) for k, v in pairs}
    except (ValueError, TypeError):
        raise argparse.ArgumentTypeError(f"{value!r}: want image=N or '{{\"image\": N}}'") from None
    if not isinstance(limits, dict) or set(limits) != {"image"} or not isinstance(limits["image"], int) \
            or limits["image"] < 0:
        raise argparse.ArgumentTypeError(f"{value!r}: only images are taken here: image=N with N >= 0")
    return limits["image"]
