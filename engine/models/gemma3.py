"""Gemma 3 (text): the Llama skeleton with Gemma's differences.

    embeddings    scaled by sqrt(hidden_size), the factor rounded to the model dtype (as HF);
                  a step's image rows (ctx.mm, engine/models/gemma3_vl.py) replace them after
    norms         four per layer (before and after attention, before and after the MLP),
                  each x * (1 + w) in float32 (GemmaRMSNorm); q and k normed per head
    MLP           GeGLU: gelu(tanh approximation) of gate, times up
    rotary        two tables: the windowed ("sliding_attention") layers use
                  rope_local_theta, the full layers rope_theta with the model's scaling
    attention     scores scale by query_pre_attn_scalar**-0.5: the backends scale by
                  head_dim**-0.5, so q is pre-scaled when the two differ; windowed layers
                  pass their window to the backend
    head          tied to the embedding (through the quantized kernel where it is stored so)

Fused qkv/gate_up, weight loading, tensor-parallel sharding and the logits are Llama's
(inherited): the layer names are the same.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.layers.activation import GeluAndMul
from engine.layers.norm import GemmaRMSNorm
from engine.layers.parallel import SINGLE, TPShard, local_sizes, row_parallel, vocab_embedding, vocab_parallel_embed
from engine.layers.rotary import Rope, RotaryEmbedding
from engine.layers import Layer
from engine.models.config import LOCAL_ROPE_THETA, ModelArchConfig
from engine.models.llama import MLP, Attention, ForwardContext, LlamaForCausalLM





def is_local(cfg: ModelArchConfig, layer: int) -> bool:
    return cfg.layer_types is not None and cfg.layer_types[layer] == "sliding_attention"


class Gemma3Attention(Attention):
    def __init__(self, cfg: ModelArchConfig, layer_idx: int, shard: TPShard = SINGLE) -> None:
        super().__init__(cfg, layer_idx, shard)
        self.q_norm = GemmaRMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        scalar = cfg.query_pre_attn_scalar or cfg.head_dim
        # The backends multiply scores by head_dim**-0.5; Gemma wants scalar**-0.5.
        self.q_scale = None if scalar == cfg.head_dim else (cfg.head_dim / scalar) ** 0.5

    def forward(self, x: torch.Tensor, rope: Rope, ctx: ForwardContext) -> torch.Tensor:
        heads = self.num_heads + 2 * self.num_kv_heads
        q, k, v = self.qkv_proj(x).view(-1, heads, self.head_dim).split(
            [self.num_heads, self.num_kv_heads, self.num_kv_heads], dim=1)
        qk = torch.cat([self.q_norm(q), self.k_norm(k)], dim=1)
        q, k = rope.rotate(qk).split([self.num_heads, self.num_kv_heads], dim=1)
        if self.q_scale is not None:
            q = q * self.q_scale
        out = ctx.backend.forward(q, k, v, ctx.kv_caches[self.layer_idx], ctx.meta,
                                  sliding_window=self.sliding_window)
        return row_parallel(self.o_proj, out.reshape(-1, self.q_size), self.shard)


class Gemma3MLP(MLP):
    def __init__(self, cfg: ModelArchConfig, shard: TPShard = SINGLE) -> None:
        super().__init__(cfg, shard)
        self.act = GeluAndMul()


class Gemma3DecoderLayer(Layer):
    def __init__(self, cfg: ModelArchConfig, layer_idx: int, shard: TPShard = SINGLE) -> None:
        super().__init__()
        self.is_local = is_local(cfg, layer_idx)
        self.self_attn = Gemma3Attention(cfg, layer_idx, shard)
        self.mlp = Gemma3MLP(cfg, shard)
        norms = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                 "post_feedforward_layernorm")
        for name in norms:
            setattr(self, name, GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps))

    def forward(self, x: torch.Tensor, rope: Rope, ctx: ForwardContext) -> torch.Tensor:
        """The residual stream in, the residual stream out (Gemma norms each branch's output
        before adding it, so the add cannot fuse into the next input norm as in Llama)."""
        h = self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), rope, ctx))
        h, x = self.pre_feedforward_layernorm(h, x)
        return x + self.post_feedforward_layernorm(self.mlp(h))


class Gemma3Model(nn.Module):
    def __init__(self, cfg: ModelArchConfig, max_positions: int, shard: TPShard = SINGLE) -> None:
        super().__init__()
        self.shard, self.vocab_size, self.hidden_size = shard, cfg.vocab_size, cfg.hidden_size
        self.embed_tokens = vocab_embedding(cfg, shard)
        self.rotary = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling)
        self.rotary_local = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_local_theta or LOCAL_ROPE_THETA,
                                            None)
        self.layers = nn.ModuleList(Gemma3DecoderLayer(cfg, i, shard) for i in range(cfg.num_layers))
        self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        x = vocab_parallel_embed(self.embed_tokens, input_ids, self.shard, self.vocab_size)
        x = x * torch.tensor(self.hidden_size ** 0.5).to(x.dtype)  # HF rounds the factor to the dtype
        if ctx.mm is not None:  # image placeholders take the vision embeddings, unscaled (as HF)
            x = x.index_copy(0, ctx.mm.rows, ctx.mm.embeds)
        ropes = (self.rotary(positions, x.dtype), self.rotary_local(positions, x.dtype))
        for layer in self.layers:
            x = layer(x, ropes[layer.is_local], ctx)
        return self.norm(x)


class Gemma3ForCausalLM(LlamaForCausalLM):
    def __init__(self, cfg: ModelArchConfig, max_positions: int, shard: TPShard = SINGLE) -> None:
        nn.Module.__init__(self)
        self.config, self.shard = cfg, shard
        self.model = Gemma3Model(cfg, max_positions, shard)
        self.lm_head = nn.Linear(cfg.hidden_size, local_sizes(cfg, shard)["vocab_rows"], bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def init_non_persistent(self, device: str | torch.device) -> None:
        super().init_non_persistent(device)
        self.model.rotary_local.build(device)


# Gemma 3's chat template (from its tokenizer_config.json), for GGUF files converted without
# one: a system message prefixes the first user turn; an image part is <start_of_image>.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}"
    "{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}{%- set first_user_prefix = '' -%}{%- set loop_messages = messages -%}{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{%- endif -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') }}"
    "{%- if message['content'] is string -%}{{ message['content'] | trim }}"
    "{%- else -%}{%- for item in message['content'] -%}"
    "{%- if item['type'] == 'image' -%}{{ '<start_of_image>' }}"
    "{%- elif item['type'] == 'text' -%}{{ item['text'] | trim }}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{{ '<end_of_turn>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"
)
