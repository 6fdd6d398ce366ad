"""The shared-memory collectives of CPU tensor-parallel ranks (engine/distributed/shm.py), on
three spawned ranks: all-reduce (float32 and bfloat16, every rank the same bits), gather and
broadcast, interleaved over many rounds so both phases of the buffer are reused, with the
tensors and messages too big for a slot going over gloo in between."""

from __future__ import annotations

import multiprocessing
import os

import torch
import torch.multiprocessing as mp

from engine.distributed import state
from engine.distributed.shm import SLOT_BYTES, create_handle
from engine.distributed.state import TPShard, all_reduce, broadcast_object, destroy_group, gather_vocab, init_group
from helpers import free_port

SIZE, ROUNDS = 3, 40


def inputs(rank: int, round_: int, shape: tuple[int, ...], dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * round_ + rank)
    return torch.randn(shape, generator=g).to(dtype)


def expected_sum(round_: int, shape: tuple[int, ...], dtype) -> torch.Tensor:
    total = inputs(0, round_, shape, dtype).to(torch.float32)
    for r in range(1, SIZE):
        total += inputs(r, round_, shape, dtype)
    return total.to(dtype)


def run_rank(rank: int, port: int, handle) -> None:
    shard = TPShard(rank, SIZE)
    init_group(shard, port, "cpu", handle)
    assert state._shm is not None
    big = (SLOT_BYTES // 4 + 1,)  # one float past a slot: gloo
    for i in range(ROUNDS):
        for shape, dtype in (((5, 64), torch.float32), ((3, 128), torch.bfloat16)):
            x = inputs(rank, i, shape, dtype)
            all_reduce(x, shard)
            assert torch.equal(x, expected_sum(i, shape, dtype)), (rank, i, dtype)  # the same bits everywhere
        if i % 10 == 0:
            x = inputs(rank, i, big)
            all_reduce(x, shard)
            torch.testing.assert_close(x, expected_sum(i, big, torch.float32))
        logits = inputs(rank, i, (2, 7))
        gathered = gather_vocab(logits, shard, vocab_size=SIZE * 7 - 2)
        if rank == 0:
            full = torch.cat([inputs(r, i, (2, 7)) for r in range(SIZE)], dim=-1)[:, :SIZE * 7 - 2]
            assert torch.equal(gathered, full)
        else:
            assert gathered is None
        message = {"round": i, "rows": list(range(i))} if rank == 0 else None
        assert broadcast_object(message, shard) == {"round": i, "rows": list(range(i))}
        if i % 10 == 5:  # past a slot: the rest follows over gloo
            payload = bytes(range(256)) * (SLOT_BYTES // 256 + 10)
            assert broadcast_object(payload if rank == 0 else None, shard) == payload
    assert not os.path.exists(handle.path)  # rank 0 unlinked it once every rank had mapped it
    destroy_group()


def test_shared_memory_collectives_on_three_ranks():
    handle = create_handle(SIZE, multiprocessing.get_context("spawn"))
    try:
        mp.start_processes(run_rank, args=(free_port(), handle), nprocs=SIZE, start_method="spawn")
    finally:
        assert not os.path.exists(handle.path)
