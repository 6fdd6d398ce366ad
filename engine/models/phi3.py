"""Phi-3: the Llama architecture with q/k/v and gate/up already fused in the checkpoint,
and LongRoPE scaling (engine/layers/rotary.py, `longrope_params`).

The fused checkpoint tensors are split back into their q, k, v and gate, up parts as they
stream in, so that the Llama loader's stacking, tensor-parallel sharding and int4/int8
quantization apply to Phi-3 unchanged.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator

import torch

from engine.layers.parallel import SINGLE, TPShard, shard_rows
from engine.layers.quantized import QuantizedTensor
from engine.models.config import ModelArchConfig
from engine.models.llama import LlamaForCausalLM

log = logging.getLogger("pagedserve.engine")
Weight = torch.Tensor | QuantizedTensor


class Phi3ForCausalLM(LlamaForCausalLM):
    def __init__(self, cfg: ModelArchConfig, max_positions: int, shard: TPShard = SINGLE) -> None:
        super().__init__(cfg, max_positions, shard)
        scaling = cfg.rope_scaling or {}
        if scaling.get("rope_type") == "longrope" and shard.rank == 0:
            original = scaling["original_max_position_embeddings"]
            log.info("LongRoPE: the %s factors for every request (max_model_len %d, original length %d)",
                     "long" if max_positions > original else "short", max_positions, original)

    def load_weights(self, weights: Iterable[tuple[str, Weight]]) -> None:
        super().load_weights(split_fused(weights, self.config))


def split_fused(weights: Iterable[tuple[str, Weight]], cfg: ModelArchConfig) -> Iterator[tuple[str, Weight]]:
    """Phi-3's `qkv_proj` ([q heads | kv heads | kv heads] rows) and `gate_up_proj` ([gate |
    up] rows) as the separate q/k/v and gate/up tensors Llama checkpoints have."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    for name, tensor in weights:
        if name.endswith(".self_attn.qkv_proj.weight"):
            parts = {"q_proj": (0, q), "k_proj": (q, kv), "v_proj": (q + kv, kv)}
            rows = q + 2 * kv
        elif name.endswith(".mlp.gate_up_proj.weight"):
            parts = {"gate_proj": (0, cfg.intermediate_size), "up_proj": (cfg.intermediate_size, cfg.intermediate_size)}
            rows = 2 * cfg.intermediate_size
        else:
            yield name, tensor
            continue
        if tensor.shape[0] != rows:
            raise ValueError(f"checkpoint tensor {name!r} has {tensor.shape[0]} rows, the config implies {rows}")
        base = name.rsplit(".", 2)[0]
        for part, (start, count) in parts.items():
            yield f"{base}.{part}.weight", shard_rows(tensor, start, count)
