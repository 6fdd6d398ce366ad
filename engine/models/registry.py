"""model_type -> the class that runs it. One entry per architecture family; each family's
module is imported only when a model of it is loaded."""

from __future__ import annotations

import importlib

from engine.models.config import SUPPORTED

# model_type -> (module, class). Keys must match config.SUPPORTED.
_CLASSES = {
    "llama": ("engine.models.llama", "LlamaForCausalLM"),
    "mistral": ("engine.models.llama", "LlamaForCausalLM"),
    "qwen2": ("engine.models.llama", "LlamaForCausalLM"),
    "qwen3": ("engine.models.llama", "LlamaForCausalLM"),
    "phi3": ("engine.models.phi3", "Phi3ForCausalLM"),
    "mixtral": ("engine.models.moe", "MoeForCausalLM"),
    "qwen3_moe": ("engine.models.moe", "MoeForCausalLM"),
    "gemma3_text": ("engine.models.gemma3", "Gemma3ForCausalLM"),
    "gemma3": ("engine.models.gemma3_vl", "Gemma3ForConditionalGeneration"),
    "qwen2_5_vl": ("engine.models.qwen2_5_vl", "Qwen2_5_VLForConditionalGeneration"),
    "qwen3_vl": ("engine.models.qwen3_vl", "Qwen3VLForConditionalGeneration"),
    "gpt_oss": ("engine.models.gpt_oss", "GptOssForCausalLM"),
    "bert": ("engine.models.bert", "BertModel"),
}


def model_class(model_type: str) -> type:
    """The nn.Module class for `model_type`; a clear error naming what is supported."""
    if model_type not in _CLASSES or model_type not in SUPPORTED:
        raise ValueError(f"model type {model_type!r} is not supported (supported: {', '.join(supported())})")
    module, name = _CLASSES[model_type]
    return getattr(importlib.import_module(module), name)


def supported() -> list[str]:
    return sorted(set(_CLASSES) & set(SUPPORTED))
