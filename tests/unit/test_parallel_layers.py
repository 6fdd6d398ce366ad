"""Each tensor-parallel layer (engine/layers/parallel.py) against its unsharded twin, on two
gloo ranks in spawned processes, float32: column-parallel qkv (per head, GQA and replicated
kv heads) and gate_up (per half), row-parallel o_proj/down_proj with the all-reduce (bias
once), the vocab-parallel embedding and LM head over a vocabulary that needs padding; and
quantized weights sliced in their blocks; and the plan broadcast."""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp
from torch import nn

from engine.distributed.state import TPShard, broadcast_object, destroy_group, init_group
from engine.layers.parallel import (check_shardable, local_sizes, parallel_logits, row_parallel,
                                    pad_rows, shard_checkpoint_tensor, shard_cols, shard_rows,
                                    vocab_parallel_embed)
from engine.layers.quantized import QuantLinear, quantize
from engine.models.config import ModelArchConfig
from helpers import free_port

HIDDEN, HEAD_DIM, INTER, TOKENS = 64, 16, 96, 5


def arch(num_heads: int, num_kv_heads: int, vocab_size: int = 511) -> ModelArchConfig:
    return ModelArchConfig("llama", vocab_size, HIDDEN, INTER, 1, num_heads, num_kv_heads, HEAD_DIM, 1e-6,
                           10000.0, None, 128, False)


def linear_from(weight: torch.Tensor, bias: torch.Tensor | None = None) -> nn.Linear:
    layer = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None)
    layer.weight.data.copy_(weight)
    if bias is not None:
        layer.bias.data.copy_(bias)
    return layer


def check_qkv(cfg: ModelArchConfig, shard: TPShard) -> None:
    torch.manual_seed(0)
    q, k, v = (torch.randn(n * HEAD_DIM, HIDDEN) for n in (cfg.num_heads, cfg.num_kv_heads, cfg.num_kv_heads))
    x = torch.randn(TOKENS, HIDDEN)
    name = "model.layers.0.self_attn.qkv_proj.weight"
    local = linear_from(torch.cat([shard_checkpoint_tensor(name, i, t, cfg, shard) for i, t in enumerate((q, k, v))]))
    sizes = local_sizes(cfg, shard)
    heads, kv = sizes["num_heads"], sizes["num_kv_heads"]
    out = local(x).view(TOKENS, heads + 2 * kv, HEAD_DIM)
    full_q = (x @ q.t()).view(TOKENS, cfg.num_heads, HEAD_DIM)
    full_k = (x @ k.t()).view(TOKENS, cfg.num_kv_heads, HEAD_DIM)
    first_kv = shard.kv_heads(cfg.num_kv_heads)[0]
    torch.testing.assert_close(out[:, :heads], full_q[:, shard.rank * heads:(shard.rank + 1) * heads])
    torch.testing.assert_close(out[:, heads:heads + kv], full_k[:, first_kv:first_kv + kv])
    # GQA: each local q head's kv head is the one the full model pairs it with.
    group = cfg.num_heads // cfg.num_kv_heads
    assert (shard.rank * heads) // group == first_kv and (shard.rank * heads + heads - 1) // group < first_kv + kv


def check_gate_up_and_down(cfg: ModelArchConfig, shard: TPShard) -> None:
    torch.manual_seed(1)
    gate, up, down, down_bias = torch.randn(INTER, HIDDEN), torch.randn(INTER, HIDDEN), torch.randn(HIDDEN, INTER), \
        torch.randn(HIDDEN)
    x = torch.randn(TOKENS, HIDDEN)
    name = "model.layers.0.mlp.gate_up_proj.weight"
    local = linear_from(torch.cat([shard_checkpoint_tensor(name, i, t, cfg, shard) for i, t in enumerate((gate, up))]))
    start, count = shard.split(INTER)
    g, u = local(x).split(count, dim=-1)
    torch.testing.assert_close(g, (x @ gate.t())[:, start:start + count])
    torch.testing.assert_close(u, (x @ up.t())[:, start:start + count])
    h = torch.randn(TOKENS, INTER)
    row = linear_from(shard_checkpoint_tensor("model.layers.0.mlp.down_proj.weight", None, down, cfg, shard),
                      shard_checkpoint_tensor("model.layers.0.mlp.down_proj.bias", None, down_bias, cfg, shard))
    torch.testing.assert_close(row_parallel(row, h[:, start:start + count], shard), h @ down.t() + down_bias)


def check_vocab(cfg: ModelArchConfig, shard: TPShard) -> None:
    torch.manual_seed(2)
    table = torch.randn(cfg.vocab_size, HIDDEN)
    local = shard_checkpoint_tensor("model.embed_tokens.weight", None, table, cfg, shard)
    assert local.shape[0] == -(-cfg.vocab_size // shard.size)
    ids = torch.tensor([0, 1, 255, 256, 300, cfg.vocab_size - 1])
    embed = nn.Embedding.from_pretrained(local)
    torch.testing.assert_close(vocab_parallel_embed(embed, ids, shard, cfg.vocab_size), table[ids])
    hidden = torch.randn(TOKENS, HIDDEN)
    logits = parallel_logits(linear_from(local), hidden, shard, cfg.vocab_size)
    if shard.rank == 0:
        torch.testing.assert_close(logits, hidden @ table.t())  # padding trimmed: [T, vocab_size]
    else:
        assert logits is None


def run_rank(rank: int, port: int) -> None:
    shard = TPShard(rank, 2)
    init_group(shard, port, "cpu")
    try:
        for cfg in (arch(4, 2), arch(4, 1), arch(4, 4)):  # GQA, kv heads replicated, MHA
            check_qkv(cfg, shard)
        check_gate_up_and_down(arch(4, 2), shard)
        check_vocab(arch(4, 2), shard)
        for sent in ({"rows": [1, 2, 3]}, list(range(20_000)), None):  # one broadcast, two, and STOP
            assert broadcast_object(sent if rank == 0 else "ignored", shard) == sent
    finally:
        destroy_group()


def test_parallel_layers_match_unsharded_on_two_gloo_ranks():
    mp.start_processes(run_rank, args=(free_port(),), nprocs=2, start_method="spawn")


def test_quantized_slices_are_exact():
    torch.manual_seed(3)
    for fmt in ("int4", "int8"):
        q = quantize(torch.randn(8, 128), fmt)
        full = q.dequantize()
        torch.testing.assert_close(shard_cols(q, 64, 64).dequantize(), full[:, 64:], rtol=0, atol=0)
        torch.testing.assert_close(shard_rows(q, 4, 4).dequantize(), full[4:], rtol=0, atol=0)
        padded = pad_rows(shard_rows(q, 4, 4), 6).dequantize()  # a padded vocabulary's last part
        assert padded.shape == (6, 128) and not padded[4:].any()
        off_blocks = shard_cols(q, 48, 48)  # not on block boundaries: dequantized
        assert isinstance(off_blocks, torch.Tensor)
        torch.testing.assert_close(off_blocks, full[:, 48:96], rtol=0, atol=0)
        layer = QuantLinear(64, 8, fmt)
        layer.load_rows(shard_cols(q, 0, 64), 0)
        x = torch.randn(3, 64)
        torch.testing.assert_close(layer(x), x @ full[:, :64].t(), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("heads,kv,size,message", [
    (9, 3, 2, "9 attention heads do not divide by 2; sizes that fit this model: 1, 3, 9"),
    (12, 3, 4, "3 kv heads neither divide by 4 nor divide it"),
])
def test_unshardable_models_are_refused_clearly(heads, kv, size, message):
    cfg = ModelArchConfig("llama", 100, 72 * heads, 36 * heads, 1, heads, kv, 8, 1e-6, 1e4, None, 64, False)
    with pytest.raises(ValueError, match=message):
        check_shardable(cfg, size)
