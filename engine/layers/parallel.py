"""Tensor-parallel sharding, as vLLM does it (Megatron-LM's layout), for the Llama family.

    column-parallel  qkv_proj, gate_up_proj: each rank keeps its output rows, split per part
                     (its q heads, its kv heads, its half of gate and of up), never a chunk
                     of the fused tensor; outputs stay sharded, no communication.
    row-parallel     o_proj, down_proj: each rank keeps its input columns; partial outputs
                     are summed by an all-reduce (a bias is added on rank 0 only).
    vocab-parallel   embed_tokens, lm_head: each rank keeps vocab_size / N rows (the vocab
                     padded to a multiple of N with zero rows). The embedding looks up the
                     ids it holds (the others give zeros) and all-reduces; the head computes
                     its rows' logits and gathers them on rank 0, padding trimmed.

            qkv_proj rows (num_heads=4, num_kv_heads=2, N=2)
    full    [ q0 q1 q2 q3 | k0 k1 | v0 v1 ]
    rank 0  [ q0 q1 | k0 | v0 ]      rank 1  [ q2 q3 | k1 | v1 ]

The layers themselves stay `nn.Linear` / `QuantLinear` / `nn.Embedding` of the local
shape (so quantization and the attention backends see ordinary layers of fewer heads);
this module says which slice of each checkpoint tensor a rank keeps, and holds the
collective steps the model calls. A quantized weight is sliced in its blocks where that
is exact: any rows, and input columns on 32-value block boundaries; FP8 any rows, and
input columns anywhere (block scales: on their column blocks).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from cpu_kernels.fp8_format import Fp8Weight
from engine.distributed.state import SINGLE, TPShard, all_reduce, gather_vocab
from engine.layers.quantized import BLOCK, QuantizedTensor

if TYPE_CHECKING:  # type hints only: engine.models builds on these layers, not the reverse
    from engine.models.config import ModelArchConfig

Weight = torch.Tensor | QuantizedTensor | Fp8Weight
ROW_PARALLEL = ("o_proj", "down_proj")  # layers whose input columns are split


def check_shardable(cfg: ModelArchConfig, size: int) -> None:
    """Raise a ValueError a person can act on when `cfg` cannot be split over `size` ranks."""
    if size == 1:
        return
    fits = [n for n in range(1, cfg.num_heads + 1) if _divides(cfg, n)]
    hint = f"; sizes that fit this model: {', '.join(map(str, fits))}"
    if cfg.num_heads % size:
        raise ValueError(f"tensor_parallel_size {size}: the model's {cfg.num_heads} attention heads "
                         f"do not divide by {size}{hint}")
    kv = cfg.num_kv_heads
    if kv % size and size % kv:
        raise ValueError(f"tensor_parallel_size {size}: the model's {kv} kv heads neither divide by "
                         f"{size} nor divide it (to be replicated){hint}")
    if cfg.intermediate_size % size:
        raise ValueError(f"tensor_parallel_size {size}: the MLP width {cfg.intermediate_size} does "
                         f"not divide by {size}{hint}")


def _divides(cfg: ModelArchConfig, n: int) -> bool:
    kv = cfg.num_kv_heads
    return cfg.num_heads % n == 0 and (kv % n == 0 or n % kv == 0) and cfg.intermediate_size % n == 0


def local_sizes(cfg: ModelArchConfig, shard: TPShard) -> dict[str, int]:
    """The per-rank widths the model builds its layers with."""
    return {"num_heads": cfg.num_heads // shard.size, "num_kv_heads": shard.kv_heads(cfg.num_kv_heads)[1],
            "intermediate_size": cfg.intermediate_size // shard.size,
            "vocab_rows": shard.vocab(cfg.vocab_size)[1]}


def shard_checkpoint_tensor(name: str, part: int | None, tensor: Weight, cfg: ModelArchConfig,
                            shard: TPShard) -> Weight:
    """This rank's slice of checkpoint tensor `name` (part `part` of a fused layer: q, k, v
    or gate, up). Tensors not listed (norms) are replicated."""
    if shard.size == 1:
        return tensor
    d = cfg.head_dim
    if ".qkv_proj." in name:
        if part == 0:
            return shard_rows(tensor, shard.rank * (cfg.num_heads // shard.size) * d,
                              cfg.num_heads // shard.size * d)
        first, count = shard.kv_heads(cfg.num_kv_heads)
        return shard_rows(tensor, first * d, count * d)
    if ".gate_up_proj." in name:
        return shard_rows(tensor, *shard.split(cfg.intermediate_size))
    if name.endswith(tuple(f"{layer}.weight" for layer in ROW_PARALLEL)):
        return shard_cols(tensor, *shard.split(tensor.shape[1]))
    if name.endswith(("down_proj.bias", "o_proj.bias")):  # added once, after the all-reduce sums the ranks
        return tensor if shard.rank == 0 else torch.zeros_like(tensor)
    if name.endswith("self_attn.sinks"):  # one per query head: this rank's heads
        return tensor.narrow(0, shard.rank * (cfg.num_heads // shard.size), cfg.num_heads // shard.size)
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        first, rows = shard.vocab(cfg.vocab_size)
        return pad_rows(shard_rows(tensor, first, min(rows, cfg.vocab_size - first)), rows)
    return tensor


def shard_rows(t: Weight, start: int, count: int) -> Weight:
    if isinstance(t, Fp8Weight):
        return t.rows(start, count)
    if isinstance(t, QuantizedTensor):
        return t.map_rows(lambda p: p.narrow(0, start, count).contiguous())
    return t.narrow(0, start, count).contiguous()


def shard_cols(t: Weight, start: int, count: int) -> Weight:
    """Columns start..start+count. A quantized weight keeps its blocks when the slice falls
    on block boundaries; otherwise, or when act-order scattered its groups over the columns
    (`perm`), it is dequantized (the layer then runs dense: see `quantize_modules`, which
    keeps such layers dense, and loader.linear_formats). FP8 keeps its bytes: per-tensor and
    per-channel scales for any slice, block scales on their column blocks (linear_formats
    keeps a layer whose rank width is not a multiple of them dense)."""
    if isinstance(t, Fp8Weight):
        return t.columns(start, count)
    if not isinstance(t, QuantizedTensor):
        return t.narrow(1, start, count).contiguous()
    if start % BLOCK or count % BLOCK or t.perm is not None:
        return t.dequantize().narrow(1, start, count).contiguous()
    per_byte = 2 if t.format == "int4" else 1
    blocks = slice(start // BLOCK, (start + count) // BLOCK)
    return QuantizedTensor(t.format, t.qweight[:, start // per_byte:(start + count) // per_byte].contiguous(),
                           t.scales[:, blocks].contiguous(),
                           None if t.zeros is None else t.zeros[:, blocks].contiguous())


def pad_rows(t: Weight, rows: int) -> Weight:
    """`t` with zero rows appended up to `rows` (a padded vocabulary's last part)."""
    extra = rows - t.shape[0]
    if extra == 0:
        return t
    if isinstance(t, QuantizedTensor):  # zero scales and zeros: the padding rows' weights are 0
        return t.map_rows(lambda p: F.pad(p, (0, 0, 0, extra)))
    return F.pad(t, (0, 0, 0, extra))


def row_parallel(layer: nn.Module, x: torch.Tensor, shard: TPShard) -> torch.Tensor:
    """A row-parallel layer's output: the local partial product, summed over ranks."""
    return all_reduce(layer(x), shard)


def vocab_embedding(cfg: ModelArchConfig, shard: TPShard) -> nn.Embedding:
    """This rank's rows of the token table, uninitialised: the checkpoint fills them.
    (nn.Embedding's own random init, normal_, on the meta device the model is built on imports
    torch._dynamo: a second of every engine's start-up.)"""
    return nn.Embedding.from_pretrained(torch.empty(local_sizes(cfg, shard)["vocab_rows"], cfg.hidden_size))


def vocab_parallel_embed(embed: nn.Module, ids: torch.Tensor, shard: TPShard, vocab_size: int
                         ) -> torch.Tensor:
    """Embeddings of `ids` from a vocab-parallel table: each rank looks up the ids in its
    rows (zeros for the others), and an all-reduce sums them."""
    if shard.size == 1:
        return embed(ids)
    first, rows = shard.vocab(vocab_size)
    local = ids - first
    mine = (local >= 0) & (local < rows)
    x = embed(torch.where(mine, local, torch.zeros_like(local)))
    x = x * mine.unsqueeze(-1).to(x.dtype)
    return all_reduce(x, shard)


def parallel_logits(head: nn.Module, hidden: torch.Tensor, shard: TPShard, vocab_size: int
                    ) -> torch.Tensor | None:
    """[T, vocab_size] logits on rank 0 (None elsewhere): each rank's rows, gathered."""
    return gather_vocab(head(hidden), shard, vocab_size)


__all__ = ["SINGLE", "TPShard", "check_shardable", "local_sizes", "shard_checkpoint_tensor",
           "row_parallel", "vocab_parallel_embed", "parallel_logits"]
