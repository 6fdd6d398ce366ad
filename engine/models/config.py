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
    # HF checkpoints only ("gguf": False): engine/models/phi3.py and engine/models/moe.py
    "phi3": {"gguf": False},
    "mixtral": {"moe": True, "gguf": False},
    "qwen3_moe": {"qk_norm": True, "moe": True, "gguf": False},
    "gemma3_text": {"qk_norm": True},  # the rest of Gemma 3 lives in engine/models/gemma3.py
    "gemma3": {"qk_norm": True, "gguf": False},  # Gemma 3 4B+ with its SigLIP encoder: engine/models/gemma3_vl.py
    # Qwen2.5-VL: Qwen2's language model with M-RoPE, and its vision tower: engine/models/qwen2_5_vl.py
    "qwen2_5_vl": {"qkv_bias": True, "gguf": False, "vision": True},
    # Qwen3-VL (dense): Qwen3's language model with interleaved M-RoPE and DeepStack, and its
    # vision tower: engine/models/qwen3_vl.py
    "qwen3_vl": {"qk_norm": True, "gguf": False, "vision": True},
    # engine/models/gpt_oss.py: attention sinks, biased attention and experts, alternating windows.
    "gpt_oss": {"moe": True, "gguf": False, "attention_sinks": True},
    # Encoders (engine/models/bert.py): bidirectional, no KV cache, served for embed / score.
    "bert": {"encoder": True, "gguf": False},
}
# GGUF general.architecture -> our model_type, where they differ.
GGUF_ARCHS = {"gemma3": "gemma3_text"}


def gguf_model_type(arch: str | None, num_experts: int = 0) -> str:
    """Our model_type for a GGUF file's general.architecture (and {arch}.expert_count: Mixtral
    GGUFs say "llama"); a clear error naming what is supported."""
    model_type = GGUF_ARCHS.get(arch, arch)
    gguf_types = {t for t, flags in SUPPORTED.items() if flags.get("gguf", True)}
    if model_type not in gguf_types or num_experts:
        names = sorted({a for a, t in GGUF_ARCHS.items() if t in gguf_types} | gguf_types - set(GGUF_ARCHS.values()))
        experts = " with experts" if model_type in gguf_types else ""
        raise ValueError(f"GGUF architecture {arch!r}{experts} is not supported (supported: {', '.join(names)}; "
                         "Phi-3 and mixture-of-experts models load from HF checkpoints)")
    return model_type


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
    o_proj_bias: bool = False  # HF's attention_bias: o_proj has one too (gpt-oss)
    attention_sinks: bool = False  # gpt-oss: a learned logit per head in every softmax's denominator
    sliding_window: int | None = None  # tokens a windowed layer attends to (itself included)
    # Per layer "sliding_attention" or "full_attention" (Gemma 3's 5:1 pattern); None: every
    # layer is windowed when sliding_window is set (Mistral), else full.
    layer_types: tuple[str, ...] | None = None
    # Mixture of experts (Mixtral, Qwen3-MoE): the layers whose MLP is a sparse MoE block.
    moe_layers: tuple[int, ...] = ()
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0  # each expert's width (dense layers use intermediate_size)
    norm_topk_prob: bool = True  # renormalise the top-k routing weights to sum to 1
    swiglu_alpha: float = 0.0  # gpt-oss's clamped SwiGLU: gate * sigmoid(alpha * gate) * (up + 1)
    swiglu_limit: float = 0.0  # ... with gate <= limit and |up| <= limit
    rope_local_theta: float | None = None  # Gemma 3: the windowed layers' rotary base
    query_pre_attn_scalar: float | None = None  # Gemma 3: scores scale by its **-0.5, not head_dim's
    encoder: bool = False  # BERT: bidirectional attention, learned positions, no KV cache
    type_vocab_size: int = 0  # BERT: token types (segment A / B of a pair)
    num_labels: int = 0  # a *ForSequenceClassification head's labels (a cross-encoder); 0: none
    # Vision-language models: what their vision encoder needs (its shape, the image token ids),
    # keyed as each family's model file reads it; None: a text-only model.
    vision: dict | None = None

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
    def from_hf(cls, hf_config, model_type: str | None = None) -> ModelArchConfig:
        """From a transformers PretrainedConfig (v4 `rope_scaling` or v5 `rope_parameters`).
        `model_type`: read it as that type's config (a vision-language model's text_config,
        whose own model_type no model class runs)."""
        model_type = model_type or hf_config.model_type
        if model_type not in SUPPORTED:
            raise ValueError(f"model type {model_type!r} is not supported (supported: {sorted(SUPPORTED)})")
        flags = SUPPORTED[model_type]
        c = hf_config
        if model_type == "gemma3":
            return gemma3_vl_config(c)
        if model_type == "qwen2_5_vl":
            return qwen2_5_vl_config(c)
        if model_type == "qwen3_vl":
            return qwen3_vl_config(c)
        if flags.get("encoder"):
            return _encoder_from_hf(c)
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        theta, scaling = _rope_from_hf(c)
        window = getattr(c, "sliding_window", None)
        if model_type in ("qwen2", "qwen3_moe") and not getattr(c, "use_sliding_window", False):
            window = None
        partial = ((getattr(c, "rope_parameters", None) or {}).get("partial_rotary_factor")
                   or getattr(c, "partial_rotary_factor", None) or 1.0)
        if partial != 1.0:  # e.g. Phi-4-mini: only part of each head rotates
            raise ValueError(f"{model_type}: partial_rotary_factor {partial} is not supported (only 1.0)")
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
            o_proj_bias=bool(getattr(c, "attention_bias", False)) and model_type == "gpt_oss",
            attention_sinks=flags.get("attention_sinks", False),
            sliding_window=window, layer_types=_layer_types(c) if window else None,
            **_moe_from_hf(c) if flags.get("moe") else {})
        if model_type == "gemma3_text":
            cfg = dataclasses.replace(cfg, **gemma3_fields(c))
        return cfg


def _encoder_from_hf(c) -> ModelArchConfig:
    """BERT's config: LayerNorm (its eps in rms_norm_eps), absolute positions, no rotary."""
    if getattr(c, "position_embedding_type", "absolute") != "absolute":
        raise ValueError(f"bert: position_embedding_type {c.position_embedding_type!r} is not supported")
    classifier = any(a.endswith("ForSequenceClassification") for a in (c.architectures or ()))
    return ModelArchConfig(
        model_type=c.model_type, vocab_size=c.vocab_size, hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size, num_layers=c.num_hidden_layers, num_heads=c.num_attention_heads,
        num_kv_heads=c.num_attention_heads, head_dim=c.hidden_size // c.num_attention_heads,
        rms_norm_eps=c.layer_norm_eps, rope_theta=0.0, rope_scaling=None,
        max_position_embeddings=c.max_position_embeddings, tie_word_embeddings=False, encoder=True,
        type_vocab_size=c.type_vocab_size, num_labels=c.num_labels if classifier else 0)


def _moe_from_hf(c) -> dict:
    """Mixtral: every layer sparse, experts as wide as `intermediate_size`, top-k always
    renormalised. Qwen3-MoE: layer i is sparse unless listed in `mlp_only_layers` or
    (i + 1) is not a multiple of `decoder_sparse_step`; experts `moe_intermediate_size`."""
    num_experts = getattr(c, "num_local_experts", None) or getattr(c, "num_experts", 0)
    extra = {}
    if c.model_type == "gpt_oss":  # every layer sparse; softmax over the top-k logits
        layers = range(c.num_hidden_layers)
        width, renormalise = c.intermediate_size, True
        extra = dict(swiglu_alpha=float(c.swiglu_alpha), swiglu_limit=float(c.swiglu_limit))
    elif c.model_type == "mixtral":
        layers = range(c.num_hidden_layers)
        width, renormalise = c.intermediate_size, True
    else:
        skip, step = set(getattr(c, "mlp_only_layers", None) or ()), c.decoder_sparse_step
        layers = [i for i in range(c.num_hidden_layers)
                  if i not in skip and num_experts > 0 and (i + 1) % step == 0]
        width, renormalise = c.moe_intermediate_size, bool(c.norm_topk_prob)
    if not 0 < c.num_experts_per_tok <= max(num_experts, 1):
        raise ValueError(f"num_experts_per_tok {c.num_experts_per_tok} must be in 1..{num_experts}")
    return dict(moe_layers=tuple(layers), num_experts=num_experts, num_experts_per_tok=c.num_experts_per_tok,
                moe_intermediate_size=width, norm_topk_prob=renormalise, **extra)


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
    if rope_type == "default":
        return float(theta), None
    scaling = dict(scaling)
    if rope_type in ("longrope", "su"):  # Phi-3: v4 configs keep these outside rope_scaling
        scaling["rope_type"] = "longrope"
        original = scaling.setdefault("original_max_position_embeddings", c.original_max_position_embeddings)
        scaling.setdefault("factor", c.max_position_embeddings / original)  # as HF's default
    return float(theta), scaling


# -- Gemma 3's configuration (its model is engine/models/gemma3.py) --------------------

# Gemma 3 defaults for what a GGUF file does not record (HF's Gemma3TextConfig and llama.cpp).
LOCAL_ROPE_THETA = 10_000.0
SLIDING_WINDOW_PATTERN = 6  # every 6th layer attends globally, the others through the window


def gemma3_fields(c) -> dict:
    """ModelArchConfig fields of a transformers Gemma3TextConfig beyond the Llama ones."""
    for name in ("attn_logit_softcapping", "final_logit_softcapping"):
        if getattr(c, name, None) is not None:
            raise ValueError(f"gemma3: {name}={getattr(c, name)} is not supported (Gemma 2's soft-capping)")
    if getattr(c, "use_bidirectional_attention", False):
        raise ValueError("gemma3: use_bidirectional_attention is not supported (causal models only)")
    params = getattr(c, "rope_parameters", None) or {}
    full = params.get("full_attention") or {}
    local = params.get("sliding_attention") or {}
    if (local.get("rope_type") or "default") != "default":
        raise ValueError(f"gemma3: rope scaling {local.get('rope_type')!r} on the windowed layers is not supported")
    scaling = None if (full.get("rope_type") or "default") == "default" else dict(full)
    return dict(rope_theta=float(full.get("rope_theta", getattr(c, "rope_theta", 1_000_000.0))),
                rope_scaling=scaling,
                rope_local_theta=float(local.get("rope_theta", LOCAL_ROPE_THETA)),
                layer_types=tuple(c.layer_types), sliding_window=c.sliding_window,
                query_pre_attn_scalar=float(c.query_pre_attn_scalar))


def gemma3_vl_config(c) -> ModelArchConfig:
    """A transformers Gemma3Config (model_type "gemma3", the 4B+ models): its text_config's
    language model, the head tied as the top-level config says, and `vision` for
    engine/models/gemma3_vl.py (the SigLIP encoder's shape, the projector's tokens per image,
    the image token ids)."""
    v = c.vision_config
    if v.hidden_act not in ("gelu_pytorch_tanh", "gelu"):
        raise ValueError(f"gemma3: vision hidden_act {v.hidden_act!r} is not supported (gelu_pytorch_tanh, gelu)")
    side = v.image_size // v.patch_size
    tokens_side = int(c.mm_tokens_per_image ** 0.5)
    if tokens_side ** 2 != c.mm_tokens_per_image or side % tokens_side or v.image_size % v.patch_size:
        raise ValueError(f"gemma3: mm_tokens_per_image {c.mm_tokens_per_image} must be a square whose side divides "
                         f"the {v.image_size // v.patch_size}-patch side (image_size {v.image_size}, "
                         f"patch_size {v.patch_size})")
    vision = {"hidden_size": v.hidden_size, "intermediate_size": v.intermediate_size,
              "num_layers": v.num_hidden_layers, "num_heads": v.num_attention_heads, "num_channels": v.num_channels,
              "image_size": v.image_size, "patch_size": v.patch_size, "layer_norm_eps": v.layer_norm_eps,
              "gelu_tanh": v.hidden_act == "gelu_pytorch_tanh", "mm_tokens_per_image": c.mm_tokens_per_image,
              "image_token_id": c.image_token_index, "boi_token_id": c.boi_token_index,
              "eoi_token_id": c.eoi_token_index}
    return dataclasses.replace(ModelArchConfig.from_hf(c.text_config), model_type="gemma3", vision=vision,
                               tie_word_embeddings=bool(getattr(c, "tie_word_embeddings", True)))


def qwen2_5_vl_config(c) -> ModelArchConfig:
    """A transformers Qwen2_5_VLConfig: Qwen2's language model (from text_config in transformers
    5, the top level in older configs) and `vision` for engine/models/qwen2_5_vl.py (the vision
    tower's shape, the image token ids, and mrope_section: how many of a head's frequency pairs
    rotate by each of a token's three positions)."""
    text = getattr(c, "text_config", None) or c
    v = c.vision_config
    if v.hidden_act != "silu":
        raise ValueError(f"qwen2_5_vl: vision hidden_act {v.hidden_act!r} is not supported (silu)")
    rope = dict(getattr(text, "rope_parameters", None) or getattr(text, "rope_scaling", None) or {})
    head_dim = text.hidden_size // text.num_attention_heads  # as HF: the config's head_dim is ignored
    section = tuple(rope.get("mrope_section") or ())
    if sum(section) != head_dim // 2 or len(section) != 3:
        raise ValueError(f"qwen2_5_vl: mrope_section {list(section)} must be 3 parts summing to head_dim / 2 "
                         f"= {head_dim // 2}")
    vision = {name: getattr(v, name) for name in (
        "depth", "hidden_size", "intermediate_size", "num_heads", "in_channels", "patch_size", "temporal_patch_size",
        "spatial_merge_size", "window_size", "out_hidden_size")}
    vision.update(fullatt_block_indexes=tuple(v.fullatt_block_indexes),
                  rope_theta=float((getattr(v, "rope_parameters", None) or {}).get("rope_theta", 10000.0)),
                  mrope_section=section, image_token_id=c.image_token_id,
                  vision_start_token_id=c.vision_start_token_id)
    cfg = ModelArchConfig.from_hf(text, model_type="qwen2")
    scaling = cfg.rope_scaling
    if scaling and (scaling.get("rope_type") or scaling.get("type")) == "mrope":  # older configs' name for M-RoPE
        scaling = None
    tied = bool(getattr(c, "tie_word_embeddings", False) or getattr(text, "tie_word_embeddings", False))
    return dataclasses.replace(cfg, model_type="qwen2_5_vl", vision=vision, head_dim=head_dim,
                               rope_scaling=scaling, tie_word_embeddings=tied)


def qwen3_vl_config(c) -> ModelArchConfig:
    """A transformers Qwen3VLConfig: Qwen3's language model (text_config, its head_dim as
    given) and `vision` for engine/models/qwen3_vl.py (the tower's shape, the blocks DeepStack
    reads, the image token ids, mrope_section). HF's Qwen3-VL interleaves M-RoPE's sections
    whatever the config's mrope_interleaved says, and ties the head as the top level says."""
    text, v = c.text_config, c.vision_config
    if v.hidden_act not in ("gelu_pytorch_tanh", "gelu"):
        raise ValueError(f"qwen3_vl: vision hidden_act {v.hidden_act!r} is not supported (gelu_pytorch_tanh, gelu)")
    rope = dict(getattr(text, "rope_parameters", None) or getattr(text, "rope_scaling", None) or {})
    cfg = ModelArchConfig.from_hf(text, model_type="qwen3")
    section = tuple(rope.get("mrope_section") or ())
    if sum(section) != cfg.head_dim // 2 or len(section) != 3:
        raise ValueError(f"qwen3_vl: mrope_section {list(section)} must be 3 parts summing to head_dim / 2 "
                         f"= {cfg.head_dim // 2}")
    deepstack = tuple(v.deepstack_visual_indexes)
    if any(not 0 <= i < v.depth for i in deepstack) or len(set(deepstack)) != len(deepstack):
        raise ValueError(f"qwen3_vl: deepstack_visual_indexes {list(deepstack)} must be distinct blocks of "
                         f"0..{v.depth - 1}")
    vision = {name: getattr(v, name) for name in (
        "depth", "hidden_size", "intermediate_size", "num_heads", "in_channels", "patch_size", "temporal_patch_size",
        "spatial_merge_size", "out_hidden_size", "num_position_embeddings")}
    vision.update(deepstack_visual_indexes=deepstack, gelu_tanh=v.hidden_act == "gelu_pytorch_tanh",
                  rope_theta=float((getattr(v, "rope_parameters", None) or {}).get("rope_theta", 10000.0)),
                  mrope_section=section, image_token_id=c.image_token_id,
                  vision_start_token_id=c.vision_start_token_id)
    return dataclasses.replace(cfg, model_type="qwen3_vl", vision=vision,
                               tie_word_embeddings=bool(getattr(c, "tie_word_embeddings", False)))


def default_layer_types(num_layers: int) -> tuple[str, ...]:
    """The 5:1 pattern, as HF derives it when a config (or a GGUF file) lists none."""
    return tuple("sliding_attention" if (i + 1) % SLIDING_WINDOW_PATTERN else "full_attention"
                 for i in range(num_layers))
