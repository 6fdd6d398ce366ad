"""The Llama family in one file: Llama 2/3, Mistral, SmolLM2, Qwen2 (qkv bias), Qwen3 (q/k norm).

Tokens arrive flat ([T], no batch dimension, no padding), as the scheduler
packs them; attention reads and writes the paged KV cache through the
backend, so this file knows nothing about blocks. Parameter names follow HF
checkpoints, except that q/k/v and gate/up are fused into one matmul each,
which `load_weights` stacks.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from engine.attention import AttentionBackend, AttentionMetadata
from engine.layers import Layer
from engine.layers.activation import SiluAndMul
from engine.layers.fp8 import Fp8Linear
from engine.layers.parallel import (SINGLE, TPShard, local_sizes, parallel_logits, row_parallel,
                                    shard_checkpoint_tensor, vocab_embedding, vocab_parallel_embed)
from engine.layers.norm import RMSNorm
from engine.layers.quantized import QuantEmbedding, QuantizedTensor, QuantLinear
from engine.layers.rotary import Rope, RotaryEmbedding
from engine.models.config import ModelArchConfig
from engine.models.cpu_decode import cpu_decode_layers
from engine.models.multimodal import MultiModalStep

_UNSET = object()

# checkpoint name fragment -> (fused parameter, shard index)
_STACKED = {
    "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
}


@dataclass
class ForwardContext:
    """What every attention layer needs for one step."""

    backend: AttentionBackend
    meta: AttentionMetadata
    kv_caches: list[torch.Tensor]  # one per layer, shape from backend.kv_cache_shape
    mm: MultiModalStep | None = None  # image embeddings of this step (vision-language models)


class Attention(Layer):
    """This rank's heads (all of them at tensor-parallel size 1); see layers/parallel.py."""

    def __init__(self, cfg: ModelArchConfig, layer_idx: int, shard: TPShard = SINGLE) -> None:
        super().__init__()
        self.layer_idx, self.shard = layer_idx, shard
        local = local_sizes(cfg, shard)
        self.num_heads, self.num_kv_heads, self.head_dim = local["num_heads"], local["num_kv_heads"], cfg.head_dim
        self.q_size = self.num_heads * cfg.head_dim
        self.kv_size = self.num_kv_heads * cfg.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=cfg.o_proj_bias)
        # gpt-oss: this rank's heads' sink logits (float32 in the backends)
        self.sinks = nn.Parameter(torch.empty(self.num_heads), requires_grad=False) if cfg.attention_sinks else None
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.qk_norm = cfg.qk_norm
        self.sliding_window = cfg.layer_window(layer_idx)  # None: full attention

    def forward(self, x: torch.Tensor, rope: Rope, ctx: ForwardContext) -> torch.Tensor:
        heads = self.num_heads + 2 * self.num_kv_heads
        qk, v = self.qkv_proj(x).view(-1, heads, self.head_dim).split(
            [self.num_heads + self.num_kv_heads, self.num_kv_heads], dim=1)
        if self.qk_norm:
            q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
            qk = torch.cat([self.q_norm(q), self.k_norm(k)], dim=1)
        # q and k rotate together: one pass instead of two.
        q, k = rope.rotate(qk).split([self.num_heads, self.num_kv_heads], dim=1)
        out = ctx.backend.forward(q, k, v, ctx.kv_caches[self.layer_idx], ctx.meta,
                                  sliding_window=self.sliding_window, sinks=self.sinks)
        return row_parallel(self.o_proj, out.reshape(-1, self.q_size), self.shard)


class MLP(Layer):
    def __init__(self, cfg: ModelArchConfig, shard: TPShard = SINGLE) -> None:
        super().__init__()
        self.shard = shard
        self.intermediate_size = local_sizes(cfg, shard)["intermediate_size"]
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * self.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(self.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)
        self.act = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return row_parallel(self.down_proj, self.act(self.gate_up_proj(x)), self.shard)


class DecoderLayer(Layer):
    def __init__(self, cfg: ModelArchConfig, layer_idx: int, shard: TPShard = SINGLE) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, layer_idx, shard)
        self.mlp = MLP(cfg, shard)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, rope: Rope, ctx: ForwardContext
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, residual) -> (x, residual), the residual add fused into the next norm; the
        first layer's residual is None (its input is the embedding)."""
        if residual is None:
            x, residual = self.input_layernorm(x), x
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, rope, ctx)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class LlamaModel(nn.Module):
    # The layer, attention and MLP classes whose forward csrc/decode_layers.cpp repeats in C++.
    plain_layer_types = (DecoderLayer, Attention, MLP)

    def __init__(self, cfg: ModelArchConfig, max_positions: int, shard: TPShard = SINGLE) -> None:
        super().__init__()
        self.shard, self.vocab_size = shard, cfg.vocab_size
        self.embed_tokens = vocab_embedding(cfg, shard)
        self.rotary = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, shard) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.cpu_decode = _UNSET  # decode steps' layers in one C++ call (engine/models/cpu_decode.py), or None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        x = vocab_parallel_embed(self.embed_tokens, input_ids, self.shard, self.vocab_size)
        deepstack = ()  # Qwen3-VL: image features added to the image rows' hidden states after layer i
        if ctx.mm is not None:  # a vision-language model's step with images (engine/models/multimodal.py)
            if ctx.mm.embeds is not None:
                embeds, *deepstack = ctx.mm.embeds.split(x.shape[-1], dim=-1)
                x[ctx.mm.rows] = embeds
            if ctx.mm.rope_positions is not None:  # [3, T]: only an M-RoPE table (MRotaryEmbedding) reads it
                positions = ctx.mm.rope_positions
        rope = self.rotary(positions, x.dtype)
        if self.cpu_decode is _UNSET:  # at the first step: LoRA wraps the layers after loading
            self.cpu_decode = cpu_decode_layers(self) if x.device.type == "cpu" else None
        if self.cpu_decode is not None and self.cpu_decode.applies(x, rope, ctx):
            return self.norm(*self.cpu_decode(x, rope, ctx))[0]
        residual = None
        for i, layer in enumerate(self.layers):
            x, residual = layer(x, residual, rope, ctx)
            if i < len(deepstack):  # x + residual is the hidden state: the next norm adds them
                x[ctx.mm.rows] += deepstack[i]
        return self.norm(x, residual)[0]


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelArchConfig, max_positions: int, shard: TPShard = SINGLE) -> None:
        """`shard`: the tensor-parallel rank this copy is for (layers of its local width)."""
        super().__init__()
        self.config, self.shard = cfg, shard
        self.model = LlamaModel(cfg, max_positions, shard)
        self.lm_head = nn.Linear(cfg.hidden_size, local_sizes(cfg, shard)["vocab_rows"], bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def init_non_persistent(self, device: str | torch.device) -> None:
        """After building on the meta device: recompute buffers and re-tie embeddings
        (a quantized head and its embedding share one table already)."""
        self.model.rotary.build(device)
        if self.config.tie_word_embeddings and isinstance(self.lm_head, nn.Linear):
            self.lm_head.weight = self.model.embed_tokens.weight

    @staticmethod
    def linear_sources(cfg: ModelArchConfig) -> dict[str, list[str]]:
        """Each linear layer's name -> the checkpoint tensors it is built from (fused
        layers have several; a tied head reads the embedding)."""
        out = {}
        for i in range(cfg.num_layers):
            attn, mlp = f"model.layers.{i}.self_attn", f"model.layers.{i}.mlp"
            out[f"{attn}.qkv_proj"] = [f"{attn}.{p}.weight" for p in ("q_proj", "k_proj", "v_proj")]
            out[f"{attn}.o_proj"] = [f"{attn}.o_proj.weight"]
            out[f"{mlp}.gate_up_proj"] = [f"{mlp}.{p}.weight" for p in ("gate_proj", "up_proj")]
            out[f"{mlp}.down_proj"] = [f"{mlp}.down_proj.weight"]
        out["lm_head"] = ["model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"]
        return out

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        return self.model(input_ids, positions, ctx)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """[T, vocab_size] logits; under tensor parallelism every rank must call it, and
        only rank 0 gets them (None elsewhere)."""
        return parallel_logits(self.lm_head, hidden, self.shard, self.config.vocab_size)

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor | QuantizedTensor]]) -> None:
        """Copy checkpoint tensors (HF names) into our parameters and quantized layers,
        stacking fused ones; under tensor parallelism each rank keeps its slice. Raises if
        anything is left unloaded."""
        params = dict(self.named_parameters())
        quantized = {f"{n}.weight": m for n, m in self.named_modules()
                     if isinstance(m, (QuantLinear, Fp8Linear)) and not n.endswith(".table")}
        if isinstance(self.model.embed_tokens, QuantEmbedding):  # tied: the head is the table
            quantized["model.embed_tokens.weight"] = self.model.embed_tokens.table
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            if self.config.tie_word_embeddings and name == "lm_head.weight":
                continue  # same tensor as embed_tokens
            name, shard = _fused_name(name)
            tensor = shard_checkpoint_tensor(name, shard, tensor, self.config, self.shard)
            sizes = self._shard_sizes(name)
            if name in quantized:
                quantized[name].load_rows(tensor, 0 if shard is None else sum(sizes[:shard]))
            elif name in params:
                if isinstance(tensor, QuantizedTensor):
                    tensor = tensor.dequantize()
                _copy_shard(params[name], tensor, shard, sizes)
            else:
                raise ValueError(f"checkpoint tensor {name!r} has no place in {self.config.model_type}")
            loaded.add(name if shard is None else f"{name}#{shard}")
        self._check_all_loaded([*params, *quantized], loaded)

    def _shard_sizes(self, name: str) -> list[int]:
        local, d = local_sizes(self.config, self.shard), self.config.head_dim
        if "qkv_proj" in name:
            return [local["num_heads"] * d, local["num_kv_heads"] * d, local["num_kv_heads"] * d]
        return [local["intermediate_size"], local["intermediate_size"]]

    def _check_all_loaded(self, names: list[str], loaded: set[str]) -> None:
        missing = []
        for name in names:
            if self.config.tie_word_embeddings and name == "lm_head.weight":
                continue
            num_shards = 3 if "qkv_proj" in name else 2 if "gate_up_proj" in name else 0
            wanted = [f"{name}#{i}" for i in range(num_shards)] or [name]
            missing += [w for w in wanted if w not in loaded]
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} tensor(s), e.g. {missing[:3]}")


def _fused_name(name: str) -> tuple[str, int | None]:
    for fragment, (fused, shard) in _STACKED.items():
        if f".{fragment}." in name:
            return name.replace(fragment, fused), shard
    return name, None


def _copy_shard(param: nn.Parameter, tensor: torch.Tensor, shard: int | None, sizes: list[int]) -> None:
    if shard is None:
        target = param.data
    else:
        offset = sum(sizes[:shard])
        target = param.data.narrow(0, offset, sizes[shard])
    if target.shape != tensor.shape:
        raise ValueError(f"shape mismatch: checkpoint {tuple(tensor.shape)} vs parameter {tuple(target.shape)}")
    target.copy_(tensor)
