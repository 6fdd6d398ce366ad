"""Read a GGUF model (one file, or a split model's parts: gguf_header.py): architecture from
its metadata, weights under HF names.

Q4_0, Q4_1, Q8_0, Q5_0 and Q4_K tensors can come out as blocks (`QuantizedTensor`, for
the quantized layers): the first three as stored, Q5_0 re-blocked exactly to int8 (its 5-bit
values minus 16 fit a byte, under the same fp16 scale), Q4_K exactly to int4 (a float32
scale and zero per 32-value sub-block). Everything else of `DENSE_TYPES` (F32/F16/BF16,
Q5_1, the other K-quants) is dequantized to float32 by gguf-py; other types are refused.
`gguf` is imported lazily: only GGUF users need it (the GPU image lacks it).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from cpu_kernels.quant_format import QuantizedTensor
from engine.models.config import SUPPORTED, ModelArchConfig, gguf_model_type
from engine.models.gguf_header import read_gguf_layout

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
# Per architecture: GGUF names that mean something else there.
_ARCH_LAYER_NAMES = {
    "gemma3": {"ffn_norm": "pre_feedforward_layernorm", "post_attention_norm": "post_attention_layernorm",
               "post_ffw_norm": "post_feedforward_layernorm"},
}
# llama.cpp's converter stores Gemma's norm weights as 1 + w; HF (and we) keep w.
_NORM_PLUS_ONE_ARCHS = ("gemma3",)
# Tensor types gguf-py dequantizes, besides the block types below.
DENSE_TYPES = ("F32", "F16", "BF16", "Q5_1", "Q2_K", "Q3_K", "Q5_K", "Q6_K")
# llama.cpp's converter interleaves the rotary halves of q/k for these architectures.
_PERMUTED_ARCHS = ("llama", "mistral")


class GGUFTensor(NamedTuple):
    """One tensor of the file, as gguf-py's ReaderTensor has it: `data` is a view of the mapped
    file, F32/F16 values in their dtype, any other type its rows of bytes."""

    name: str
    tensor_type: object  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # GGUF's order: a row's length first
    data: np.ndarray


@dataclasses.dataclass(frozen=True)
class GGUFFile:
    metadata: dict[str, object]  # scalars and strings by key (the vocabulary's arrays are not read)
    tensors: list[GGUFTensor]


@functools.lru_cache(maxsize=2)
def _gguf(path: Path) -> GGUFFile:
    """The model's metadata and tensors (of every part, for a split model), its header read by
    gguf_header (milliseconds: gguf-py's GGUFReader spent 1.4 s of every engine start parsing
    SmolLM2's vocabulary into numpy)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import quant_shape_to_byte_shape

    layout = read_gguf_layout(path)
    # Sliced as a plain ndarray: a memmap's slices run Python (memmap.__array_finalize__) each;
    # the view's base, the memmap, keeps the file mapped.
    mapped = {file: np.memmap(file, dtype=np.uint8, mode="r").view(np.ndarray) for file in layout.files}
    tensors = []
    for info in layout.tensors:
        kind = GGMLQuantizationType(info.type)
        shape = tuple(reversed(info.dims))
        values = _VALUE_TYPES.get(kind.name)
        if values is not None:
            size = math.prod(shape) * np.dtype(values).itemsize
            data = mapped[info.file][info.offset:info.offset + size].view(values).reshape(shape)
        else:
            block, block_bytes = GGML_QUANT_SIZES[kind]
            size = math.prod(shape) * block_bytes // block
            data = mapped[info.file][info.offset:info.offset + size].reshape(quant_shape_to_byte_shape(shape, kind))
        tensors.append(GGUFTensor(info.name, kind, info.dims, data))
    return GGUFFile(layout.metadata, tensors)


# Tensor types whose data gguf-py gives as values, not bytes.
_VALUE_TYPES = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I8": np.int8, "I16": np.int16,
                "I32": np.int32, "I64": np.int64}


def read_gguf_metadata(path: Path, keys: list[str]) -> dict[str, object]:
    """The values of those of `keys` the file carries (scalars and strings)."""
    metadata = _gguf(path).metadata
    return {key: metadata[key] for key in keys if key in metadata}


def read_gguf_config(path: Path) -> ModelArchConfig:
    file = _gguf(path)
    arch = file.metadata.get("general.architecture")
    model_type = gguf_model_type(arch, file.metadata.get(f"{arch}.expert_count", 0))
    names = {t.name for t in file.tensors}
    embd = next(t for t in file.tensors if t.name == "token_embd.weight")

    def key(name: str, default=None):
        return file.metadata.get(f"{arch}.{name}", default)

    hidden, heads = key("embedding_length"), key("attention.head_count")
    scaling = None
    if key("rope.scaling.type") in ("linear",):
        scaling = {"rope_type": "linear", "factor": key("rope.scaling.factor")}
    cfg = ModelArchConfig(
        model_type=model_type, vocab_size=int(embd.shape[1]), hidden_size=hidden,
        intermediate_size=key("feed_forward_length"), num_layers=key("block_count"),
        num_heads=heads, num_kv_heads=key("attention.head_count_kv", heads),
        head_dim=key("attention.key_length", hidden // heads),
        rms_norm_eps=key("attention.layer_norm_rms_epsilon"), rope_theta=key("rope.freq_base", 10000.0),
        rope_scaling=scaling, max_position_embeddings=key("context_length"),
        tie_word_embeddings="output.weight" not in names,
        qkv_bias=SUPPORTED[model_type].get("qkv_bias", False),
        qk_norm=SUPPORTED[model_type].get("qk_norm", False), sliding_window=key("attention.sliding_window"))
    if model_type == "gemma3_text":  # what the file does not record: Gemma 3's defaults, as HF takes them
        from engine.models.config import LOCAL_ROPE_THETA, default_layer_types
        cfg = dataclasses.replace(cfg, layer_types=default_layer_types(cfg.num_layers),
                                  rope_local_theta=LOCAL_ROPE_THETA, query_pre_attn_scalar=float(cfg.head_dim))
    return cfg


# GGUF block type -> (our format, bytes per block of 32): fp16 d, [fp16 m,] then the values.
_BLOCK_TYPES = {"Q4_0": ("int4", 18), "Q4_1": ("int4", 20), "Q8_0": ("int8", 34), "Q5_0": ("int8", 22),
                "Q4_K": ("int4", 144)}  # Q4_K: per 256 values, 8 sub-blocks of 32


def gguf_block_formats(path: Path) -> dict[str, str]:
    """HF tensor name -> "int4" | "int8", for the tensors that can run as stored."""
    file = _gguf(path)
    arch = file.metadata.get("general.architecture")
    return {_hf_name(t.name, arch): _BLOCK_TYPES[t.tensor_type.name][0]
            for t in file.tensors if t.tensor_type.name in _BLOCK_TYPES}


def iter_gguf_weights(path: Path, cfg: ModelArchConfig, keep_quantized: bool = False
                      ) -> Iterator[tuple[str, torch.Tensor | QuantizedTensor]]:
    """Yield (HF name, weight) for every tensor in the file: float32 tensors, or with
    `keep_quantized` the block types (Q4_0/Q4_1/Q8_0 as stored, Q5_0/Q4_K re-blocked)."""
    from gguf.quants import dequantize

    file = _gguf(path)
    arch = file.metadata.get("general.architecture")
    for tensor in file.tensors:
        name, kind = _hf_name(tensor.name, arch), tensor.tensor_type.name
        if kind not in _BLOCK_TYPES and kind not in DENSE_TYPES:
            raise ValueError(f"GGUF tensor {tensor.name!r} has type {kind}, which is not supported "
                             f"(supported: {', '.join([*_BLOCK_TYPES, *DENSE_TYPES])})")
        if keep_quantized and kind in _BLOCK_TYPES:
            weight = _blocks(np.asarray(tensor.data), kind)
        else:
            array = dequantize(tensor.data, tensor.tensor_type)
            weight = torch.from_numpy(np.array(array, dtype=np.float32, order="C"))
            if arch in _NORM_PLUS_ONE_ARCHS and tensor.name.endswith("norm.weight"):
                weight = weight - 1  # as HF's GGUF loader does: the model adds the 1 back
        if cfg.model_type in _PERMUTED_ARCHS and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = cfg.num_heads if "q_proj" in name else cfg.num_kv_heads
            if isinstance(weight, QuantizedTensor):
                weight = weight.map_rows(lambda t: _unpermute_rotary(t, heads))
            else:
                weight = _unpermute_rotary(weight, heads)
        yield name, weight
    # Every weight above is a copy: let the file's mapping go (the pages read stay in the
    # process's RSS while it is mapped: SmolLM2's 112 MB beside its loaded weights).
    del file
    _gguf.cache_clear()


def _blocks(raw: np.ndarray, kind: str) -> QuantizedTensor:
    """[N, blocks * bytes per block] raw GGUF rows -> our block layout (scales as float32)."""
    fmt, size = _BLOCK_TYPES[kind]
    blocks = raw.reshape(raw.shape[0], -1, size)

    def half(offset: int) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(blocks[..., offset:offset + 2]).view(np.float16)[..., 0]
                                .astype(np.float32))

    def values(offset: int, dtype) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(blocks[..., offset:]).view(dtype).reshape(raw.shape[0], -1))

    if kind == "Q4_K":
        return _q4_k(blocks)
    d = half(0)
    if kind == "Q5_0":  # fp16 d, 32 high bits, 16 bytes of low nibbles: w = d * (q - 16)
        return QuantizedTensor(fmt, _q5_0_values(blocks), d)
    if kind == "Q8_0":
        return QuantizedTensor(fmt, values(2, np.int8), d)
    if kind == "Q4_1":
        return QuantizedTensor(fmt, values(4, np.uint8), d, half(2))
    return QuantizedTensor(fmt, values(2, np.uint8), d, -8 * d)  # Q4_0: w = d * (q - 8)


def _q4_k(blocks: np.ndarray) -> QuantizedTensor:
    """[N, B, 144] Q4_K super-blocks -> int4 per 32 values, exactly: sub-block s of a
    super-block is w = (d * sc[s]) * q - dmin * m[s], q in 0..15, so its float32 scale is
    d * sc[s] and its zero -(dmin * m[s]), computed as gguf-py does. The 128 bytes of q hold
    sub-blocks 2g (low nibbles) and 2g + 1 (high) in 32-byte groups g."""
    from gguf.quants import Q4_K
    rows = blocks.shape[0]
    flat = blocks.reshape(-1, 144)
    d = np.ascontiguousarray(flat[:, 0:2]).view(np.float16).astype(np.float32)
    dmin = np.ascontiguousarray(flat[:, 2:4]).view(np.float16).astype(np.float32)
    sc, m = (x.reshape(flat.shape[0], 8).astype(np.float32) for x in Q4_K.get_scale_min(flat[:, 4:16]))
    q = (flat[:, 16:].reshape(-1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)) & 15
    values = torch.from_numpy(np.ascontiguousarray(q).reshape(rows, -1))
    return QuantizedTensor.from_groups("int4", values, torch.from_numpy((d * sc).reshape(rows, -1)),
                                       torch.from_numpy((-(dmin * m)).reshape(rows, -1)))


def _q5_0_values(blocks: np.ndarray) -> torch.Tensor:
    """[N, B, 22] Q5_0 blocks -> int8 [N, B * 32] of q - 16 (value j: low nibble of byte j
    for j < 16, else high nibble of byte j - 16; bit 4 from bit j of the high word)."""
    high = np.ascontiguousarray(blocks[..., 2:6]).view(np.uint32)  # [N, B, 1]
    low = blocks[..., 6:]
    nibbles = np.concatenate([low & 15, low >> 4], axis=-1)  # [N, B, 32]
    bits = ((high >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)
    values = (nibbles | (bits << 4)).astype(np.int8) - np.int8(16)
    return torch.from_numpy(values.reshape(blocks.shape[0], -1))


def _hf_name(gguf_name: str, arch: str | None = None) -> str:
    stem, _, suffix = gguf_name.rpartition(".")
    if stem.startswith("blk."):
        _, layer, part = stem.split(".", 2)
        names = {**_LAYER_NAMES, **_ARCH_LAYER_NAMES.get(arch, {})}
        if part not in names:
            raise ValueError(f"unknown GGUF tensor {gguf_name!r}")
        return f"model.layers.{layer}.{names[part]}.{suffix}"
    if stem not in _GLOBAL_NAMES:
        raise ValueError(f"unknown GGUF tensor {gguf_name!r}")
    return f"{_GLOBAL_NAMES[stem]}.{suffix}"


def _unpermute_rotary(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    # llama.cpp stores each head's rows as interleaved pairs (x0, x_half, x1, ...);
    # HF's rotate-half layout wants the two halves contiguous.
    rows = weight.shape[0]
    half = rows // num_heads // 2
    return weight.reshape(num_heads, half, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)
