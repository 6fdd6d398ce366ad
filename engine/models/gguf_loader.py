"""Read a GGUF file: architecture from its metadata, dequantized weights under HF names.

`gguf` is imported lazily: only GGUF users need it (the GPU image lacks it).
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from engine.models.config import SUPPORTED, ModelArchConfig

# GGUF tensor name (after "blk.N.") -> HF name (after "model.layers.N.")
_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head",
}
# llama.cpp's converter interleaves the rotary halves of q/k for these architectures.
_PERMUTED_ARCHS = ("llama", "mistral")


@functools.lru_cache(maxsize=2)
def _reader(path: Path):
    # Parsing the metadata (the whole vocabulary) takes seconds: do it once per file.
    import gguf
    return gguf.GGUFReader(str(path))


def _field(reader, key: str, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def read_gguf_config(path: Path) -> ModelArchConfig:
    reader = _reader(path)
    arch = _field(reader, "general.architecture")
    if arch not in SUPPORTED:
        raise ValueError(f"GGUF architecture {arch!r} is not supported (supported: {sorted(SUPPORTED)})")
    names = {t.name for t in reader.tensors}
    embd = next(t for t in reader.tensors if t.name == "token_embd.weight")

    def key(name: str, default=None):
        return _field(reader, f"{arch}.{name}", default)

    hidden, heads = key("embedding_length"), key("attention.head_count")
    scaling = None
    if key("rope.scaling.type") in ("linear",):
        scaling = {"rope_type": "linear", "factor": key("rope.scaling.factor")}
    return ModelArchConfig(
        model_type=arch, vocab_size=int(embd.shape[1]), hidden_size=hidden,
        intermediate_size=key("feed_forward_length"), num_layers=key("block_count"),
        num_heads=heads, num_kv_heads=key("attention.head_count_kv", heads),
        head_dim=key("attention.key_length", hidden // heads),
        rms_norm_eps=key("attention.layer_norm_rms_epsilon"), rope_theta=key("rope.freq_base", 10000.0),
        rope_scaling=scaling, max_position_embeddings=key("context_length"),
        tie_word_embeddings="output.weight" not in names,
        qkv_bias=SUPPORTED[arch].get("qkv_bias", False), qk_norm=SUPPORTED[arch].get("qk_norm", False),
        sliding_window=key("attention.sliding_window"))


def iter_gguf_weights(path: Path, cfg: ModelArchConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF name, fp32 tensor) for every tensor in the file."""
    from gguf.quants import dequantize

    reader = _reader(path)
    for tensor in reader.tensors:
        name = _hf_name(tensor.name)
        array = dequantize(tensor.data, tensor.tensor_type)
        weight = torch.from_numpy(np.array(array, dtype=np.float32, order="C"))
        if cfg.model_type in _PERMUTED_ARCHS and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = cfg.num_heads if "q_proj" in name else cfg.num_kv_heads
            weight = _unpermute_rotary(weight, heads)
        yield name, weight


def _hf_name(gguf_name: str) -> str:
    stem, _, suffix = gguf_name.rpartition(".")
    if stem.startswith("blk."):
        _, layer, part = stem.split(".", 2)
        if part not in _LAYER_NAMES:
            raise ValueError(f"unknown GGUF tensor {gguf_name!r}")
        return f"model.layers.{layer}.{_LAYER_NAMES[part]}.{suffix}"
    if stem not in _GLOBAL_NAMES:
        raise ValueError(f"unknown GGUF tensor {gguf_name!r}")
    return f"{_GLOBAL_NAMES[stem]}.{suffix}"


def _unpermute_rotary(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    # llama.cpp stores each head's rows as interleaved pairs (x0, x_half, x1, ...);
    # HF's rotate-half layout wants the two halves contiguous.
    rows = weight.shape[0]
    half = rows // num_heads // 2
    return weight.reshape(num_heads, half, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)
