"""The architecture facts our model code needs, read from HF configs or GGUF metadata."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

# model_type -> how it differs from plain Llama
SUPPORTED = {
    "llama": {},
    "mistral": {},
    "qwen2": {"qkv_bias": True},
    "qwen3": {"qk_norm": True},
    "gemma3_text": {"qk_norm": True},  # the rest of Gemma 3 lives in engine/models/gemma3.py
}


@dataclass(frozen=True)
class ModelArchConfig:
    """One Llama-family model's shape. Every other architecture is a variation of these flags."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool = False  # Qwen2
    qk_norm: bool = False  # Qwen3: RMSNorm on each head of q and k before RoPE
    mlp_bias: bool = False
    sliding_window: int | None = None  # tokens a windowed layer attends to (itself included)
    # Per layer "sliding_attention" or "full_attention" (Gemma 3's 5:1 pattern); None: every
    # layer is windowed when sliding_window is set (Mistral), else full.
    layer_types: tuple[str, ...] | None = None
    rope_local_theta: float | None = None  # Gemma 3: the windowed layers' rotary base
    query_pre_attn_scalar: float | None = None  # Gemma 3: scores scale by its **-0.5, not head_dim's

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")

    def layer_window(self, layer: int) -> int | None:
        """Layer `layer`'s attention window in tokens, or None for full attention: a query
        at position i sees keys j with i - j < window (HF's convention)."""
        if self.sliding_window is None:
            return None
        if self.layer_types is not None and self.layer_types[layer] != "sliding_attention":
            return None
        return self.sliding_window

    @classmethod
    def from_hf(cls, hf_config) -> ModelArchConfig:
        """From a transformers PretrainedConfig (v4 `rope_scaling` or v5 `rope_parameters`)."""
        model_type = hf_config.model_type
        if model_type not in SUPPORTED:
            raise ValueError(f"model type {model_type!r} is not supported (supported: {sorted(SUPPORTED)})")
        flags = SUPPORTED[model_type]
        c = hf_config
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        theta, scaling = _rope_from_hf(c)
        window = getattr(c, "sliding_window", None)
        if model_type == "qwen2" and not getattr(c, "use_sliding_window", False):
            window = None
        cfg = cls(
            model_type=model_type, vocab_size=c.vocab_size, hidden_size=c.hidden_size,
            intermediate_size=c.intermediate_size, num_layers=c.num_hidden_layers,
            num_heads=c.num_attention_heads,
            num_kv_heads=getattr(c, "num_key_value_heads", None) or c.num_attention_heads,
            head_dim=head_dim, rms_norm_eps=c.rms_norm_eps, rope_theta=theta, rope_scaling=scaling,
            max_position_embeddings=c.max_position_embeddings,
            tie_word_embeddings=bool(getattr(c, "tie_word_embeddings", False)),
            qkv_bias=flags.get("qkv_bias", False) or bool(getattr(c, "attention_bias", False)),
            qk_norm=flags.get("qk_norm", False), mlp_bias=bool(getattr(c, "mlp_bias", False)),
            sliding_window=window, layer_types=_layer_types(c) if window else None)
        if model_type == "gemma3_text":
            from engine.models.gemma3 import gemma3_fields
            cfg = dataclasses.replace(cfg, **gemma3_fields(c))
        return cfg


def _layer_types(c) -> tuple[str, ...] | None:
    """HF's per-layer attention kinds where the config lists them (Qwen2 windows only the
    layers from max_window_layers on); None: every layer is windowed."""
    types = getattr(c, "layer_types", None)
    return tuple(types) if types else None


def _rope_from_hf(c) -> tuple[float, dict | None]:
    params = getattr(c, "rope_parameters", None) or {}
    theta = params.get("rope_theta", getattr(c, "rope_theta", 10000.0))
    scaling = getattr(c, "rope_scaling", None) or params
    rope_type = (scaling or {}).get("rope_type") or (scaling or {}).get("type") or "default"
    return float(theta), (None if rope_type == "default" else dict(scaling))
