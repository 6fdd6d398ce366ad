"""BERT encoders (sentence-transformers' MiniLM, BGE, E5...) and BERT cross-encoders
(`BertForSequenceClassification`), checked against Hugging Face's BertModel.

An encoder attends both ways within one sequence and keeps no KV cache: a step's sequences
run as one flat batch of tokens through the dense layers (no padding anywhere), attention
sequence by sequence (`Sequences`).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from engine.layers.parallel import SINGLE, TPShard
from engine.models.config import ModelArchConfig


DENSE_K = 384  # the widest input one bf16 matmul reduces over (see _dense)


class BertLayer(nn.Module):
    def __init__(self, cfg: ModelArchConfig) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.num_heads, self.head_dim = cfg.num_heads, cfg.head_dim
        self.qkv = nn.Linear(h, 3 * h)
        self.attn_out = nn.Linear(h, h)
        self.attn_norm = nn.LayerNorm(h, eps=cfg.rms_norm_eps, dtype=torch.float32)
        self.up = nn.Linear(h, cfg.intermediate_size)
        self.down = nn.Linear(cfg.intermediate_size, h)
        self.out_norm = nn.LayerNorm(h, eps=cfg.rms_norm_eps, dtype=torch.float32)

    def forward(self, x: torch.Tensor, batch: Sequences) -> torch.Tensor:
        """`x`: the residual stream in float32 (see BertModel.forward)."""
        q, k, v = _dense(self.qkv, x).view(-1, 3, self.num_heads, self.head_dim).unbind(1)
        attn = batch.attend(q, k, v)
        x = self.attn_norm(x + _dense(self.attn_out, attn).float())
        return self.out_norm(x + _dense(self.down, F.gelu(_dense(self.up, x))).float())


def _dense(layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """A linear layer in the weights' dtype (bf16 matmuls run on AMX / AVX512-BF16). The bias
    is added after the matmul: fused into it (addmm), oneDNN's bf16 path ran at half speed.

    In bfloat16, oneDNN picks its reduction blocking by the number of rows once the input is
    wider than DENSE_K columns (measured on the Intel AMX VM: with 1,536 columns a row's
    outputs moved by up to 0.125 with the rows beside it; with 384, never). So a wider input
    runs as matmuls of DENSE_K columns, summed in float32 in order: a text's vector does not
    depend on the texts that share its step (and it ran 20% faster than one matmul)."""
    x = x.to(layer.weight.dtype)
    width = x.shape[1]
    if layer.weight.dtype != torch.bfloat16 or width <= DENSE_K:
        return F.linear(x, layer.weight).add_(layer.bias)
    out = F.linear(x[:, :DENSE_K], layer.weight[:, :DENSE_K]).float()
    for start in range(DENSE_K, width, DENSE_K):
        out.add_(F.linear(x[:, start:start + DENSE_K], layer.weight[:, start:start + DENSE_K]))
    return out.add_(layer.bias)


class Sequences:
    """The step's sequences (lengths, in row order), for attention.

    Each attends within itself, one SDPA call per sequence: a padded batch with a key mask
    would do the work of the longest sequence for every one (3x the work for lengths spread
    evenly up to the longest) and take SDPA off its flash path; the calls cost ~0.1 ms each."""

    def __init__(self, lengths: list[int]) -> None:
        self.lengths = lengths

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """[tokens, heads, head_dim] each -> attention output [tokens, heads * head_dim]."""
        out = torch.empty(q.shape[0], q.shape[1] * q.shape[2], dtype=q.dtype, device=q.device)
        start = 0
        for n in self.lengths:
            end = start + n
            seq = [t[None, start:end].transpose(1, 2) for t in (q, k, v)]  # [1, heads, n, d]: the flash path
            out[start:end] = F.scaled_dot_product_attention(*seq)[0].transpose(0, 1).reshape(n, -1)
            start = end
        return out


class BertModel(nn.Module):
    """An encoder's hidden states; with `cfg.num_labels`, a cross-encoder's head as well."""

    PACKS_DENSE_LINEARS = False  # _dense multiplies by its layers' weights itself (engine/layers/packed_linear.py)

    def __init__(self, cfg: ModelArchConfig, max_positions: int, shard: TPShard = SINGLE) -> None:
        super().__init__()
        if shard.size > 1:
            raise ValueError("tensor_parallel_size: BERT encoders run on one rank")
        h = cfg.hidden_size
        self.cfg = cfg
        self.word_embeddings = nn.Embedding(cfg.vocab_size, h)
        self.position_embeddings = nn.Embedding(cfg.max_position_embeddings, h)
        self.token_type_embeddings = nn.Embedding(max(cfg.type_vocab_size, 1), h)
        self.embeddings_norm = nn.LayerNorm(h, eps=cfg.rms_norm_eps, dtype=torch.float32)
        self.layers = nn.ModuleList(BertLayer(cfg) for _ in range(cfg.num_layers))
        self.num_labels = cfg.num_labels
        if cfg.num_labels:  # BertForSequenceClassification: tanh(dense(CLS)) -> classifier
            self.pooler = nn.Linear(h, h)
            self.classifier = nn.Linear(h, cfg.num_labels)

    def init_non_persistent(self, device: str | torch.device) -> None:
        pass

    @staticmethod
    def linear_sources(cfg: ModelArchConfig) -> dict[str, list[str]]:
        return {}  # dense weights only: nothing to keep quantized

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, token_types: torch.Tensor,
                lengths: list[int]) -> torch.Tensor:
        """Flat tokens of `lengths` sequences, in order -> hidden states [tokens, hidden]."""
        # The residual stream and its LayerNorms stay in float32 whatever the weights' dtype: in
        # bfloat16 throughout, sentence embeddings drift to a cosine of ~0.9999 against float32;
        # the matmuls, where the time goes, still run in the weights' dtype.
        x = self.word_embeddings(input_ids).float() + self.position_embeddings(positions).float()
        x = self.embeddings_norm(x + self.token_type_embeddings(token_types).float())
        batch = Sequences(lengths)
        for layer in self.layers:
            x = layer(x, batch)
        return x

    def classify(self, cls_hidden: torch.Tensor) -> torch.Tensor:
        """[sequences, hidden] CLS states -> [sequences, labels] logits."""
        return _dense(self.classifier, torch.tanh(_dense(self.pooler, cls_hidden)))

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.named_parameters())
        loaded = set()
        for name, tensor in weights:
            ours = _our_name(name)
            if ours is None:
                continue
            target, part = ours
            if target not in params:
                if target.startswith(("pooler.", "classifier.")):
                    continue  # an embedding model's unused pooler
                raise ValueError(f"unexpected BERT weight {name!r}")
            param = params[target]
            if part is None:
                param.copy_(tensor)
            else:  # q, k, v into the fused projection
                rows = param.shape[0] // 3
                param[part * rows:(part + 1) * rows].copy_(tensor)
            loaded.add(target if part is None else f"{target}.{part}")
        expected = {n for n in params if not n.endswith("qkv.weight") and not n.endswith("qkv.bias")}
        expected |= {f"{n}.{p}" for n in params if n.endswith(("qkv.weight", "qkv.bias")) for p in range(3)}
        missing = sorted(expected - loaded)
        if missing:
            raise ValueError(f"BERT checkpoint lacks {len(missing)} weights, e.g. {missing[:3]}")


_QKV = {"query": 0, "key": 1, "value": 2}
_LAYER_PARTS = {"attention.output.dense": "attn_out", "attention.output.LayerNorm": "attn_norm",
                "intermediate.dense": "up", "output.dense": "down", "output.LayerNorm": "out_norm"}
_TOP = {"embeddings.word_embeddings": "word_embeddings", "embeddings.position_embeddings": "position_embeddings",
        "embeddings.token_type_embeddings": "token_type_embeddings", "embeddings.LayerNorm": "embeddings_norm",
        "pooler.dense": "pooler", "classifier": "classifier"}


def _our_name(name: str) -> tuple[str, int | None] | None:
    """HF's BERT weight name -> (our parameter, which of q/k/v or None); None: not a weight."""
    name = name.removeprefix("bert.")
    module, _, kind = name.rpartition(".")
    if kind not in ("weight", "bias"):
        return None  # embeddings.position_ids is a buffer
    if module in _TOP:
        return f"{_TOP[module]}.{kind}", None
    if not module.startswith("encoder.layer."):
        return None
    index, _, rest = module.removeprefix("encoder.layer.").partition(".")
    if rest.startswith("attention.self."):
        return f"layers.{index}.qkv.{kind}", _QKV[rest.removeprefix("attention.self.")]
    return f"layers.{index}.{_LAYER_PARTS[rest]}.{kind}", None
