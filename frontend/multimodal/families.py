"""Each vision-language family's prompt settings: what its chat template writes for an image,
and the text an image's placeholder tokens become (as the family's transformers processor
expands them). A new family is one entry here, its image processor in image_processors.py,
and its model file in the engine."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Family:
    placeholder: str  # the chat template's text for one image, which the expansion replaces
    before: str = ""  # text around an image's run of image tokens
    after: str = ""

    def expand(self, image_token: str, num_tokens: int) -> str:
        return self.before + image_token * num_tokens + self.after


FAMILIES = {
    # Qwen2VLProcessor: each <|image_pad|> becomes one per merged patch (the template wraps it
    # in <|vision_start|> ... <|vision_end|> already).
    "qwen2_vl": Family("<|image_pad|>"),
    "qwen2_5_vl": Family("<|image_pad|>"),
    "qwen3_vl": Family("<|image_pad|>"),  # Qwen3VLProcessor: images as Qwen2-VL's (videos differ)
    # Gemma3Processor: each <start_of_image> becomes "\n\n<start_of_image>", the soft tokens,
    # then "<end_of_image>\n\n".
    "gemma3": Family("<start_of_image>", "\n\n<start_of_image>", "<end_of_image>\n\n"),
}
