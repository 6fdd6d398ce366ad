"""Read a GGUF file: architecture from its metadata, weights under HF names.

Q4_0, Q4_1 and Q8_0 tensors can come out as they are stored (`QuantizedTensor`, for the
quantized layers); everything else is dequantized to float32 by gguf-py.
`gguf` is imported lazily: only GGUF users need it (the GPU image lacks it).
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from engine.layers.quantized import QuantizedTensor
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
    gguf_archs = sorted(a for a, flags in SUPPORTED.items() if flags.get("gguf", True))
    if arch not in gguf_archs or _field(reader, f"{arch}.expert_count", 0):  # Mixtral GGUFs say "llama"
        raise ValueError(f"GGUF architecture {arch!r}{' with experts' if arch in gguf_archs else ''} is "
                         f"not supported (supported: {', '.join(gguf_archs)}; Phi-3 and mixture-of-experts "
                         "models load from HF checkpoints)")
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


# GGUF block type -> (our format, bytes per block of 32): fp16 d, [fp16 m,] then the values.
_BLOCK_TYPES = {"Q4_0": ("int4", 18), "Q4_1": ("int4", 20), "Q8_0": ("int8", 34)}


def gguf_block_formats(path: Path) -> dict[str, str]:
    """HF tensor name -> "int4" | "int8", for the tensors that can run as stored."""
    return {_hf_name(t.name): _BLOCK_TYPES[t.tensor_type.name][0]
            for t in _reader(path).tensors if t.tensor_type.name in _BLOCK_TYPES}


def iter_gguf_weights(path: Path, cfg: ModelArchConfig, keep_quantized: bool = False
                      ) -> Iterator[tuple[str, torch.Tensor | QuantizedTensor]]:
    """Yield (HF name, weight) for every tensor in the file: float32 tensors, or with
    `keep_quantized` the Q4_0/Q4_1/Q8_0 ones as stored."""
    from gguf.quants import dequantize

    for tensor in _reader(path).tensors:
        name = _hf_name(tensor.name)
        if keep_quantized and tensor.tensor_type.name in _BLOCK_TYPES:
            weight = _blocks(np.asarray(tensor.data), tensor.tensor_type.name)
        else:
            array = dequantize(tensor.data, tensor.tensor_type)
            weight = torch.from_numpy(np.array(array, dtype=np.float32, order="C"))
        if cfg.model_type in _PERMUTED_ARCHS and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = cfg.num_heads if "q_proj" in name else cfg.num_kv_heads
            if isinstance(weight, QuantizedTensor):
                weight = weight.map_rows(lambda t: _unpermute_rotary(t, heads))
            else:
                weight = _unpermute_rotary(weight, heads)
        yield name, weight


def _blocks(raw: np.ndarray, kind: str) -> QuantizedTensor:
    """[N, blocks * bytes per block] raw GGUF rows -> our block layout (scales as float32)."""
    fmt, size = _BLOCK_TYPES[kind]
    blocks = raw.reshape(raw.shape[0], -1, size)

    def half(offset: int) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(blocks[..., offset:offset + 2]).view(np.float16)[..., 0]
                                .astype(np.float32))

    def values(offset: int, dtype) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(blocks[..., offset:]).view(dtype).reshape(raw.shape[0], -1))

    d = half(0)
    if kind == "Q8_0":
        return QuantizedTensor(fmt, values(2, np.int8), d)
    if kind == "Q4_1":
        return QuantizedTensor(fmt, values(4, np.uint8), d, half(2))
    return QuantizedTensor(fmt, values(2, np.uint8), d, -8 * d)  # Q4_0: w = d * (q - 8)


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
