"""The tensor-parallel process group and the few collectives the model and runner use.

One group per process (torch.distributed's default group): gloo on CPU, NCCL on CUDA,
joined over tcp://127.0.0.1:<port>. Every helper is a no-op at size 1, so single-rank
code calls them unconditionally.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from engine.distributed.shm import ShmComm, ShmHandle

# Workers wait in a broadcast for rank 0's next step for as long as the engine is idle, so
# the collective timeout must outlast any idle spell. Liveness comes from elsewhere: a dead
# peer closes its sockets (the blocked collective fails at once) and process watchers.
COLLECTIVE_TIMEOUT = timedelta(days=365)
BROADCAST_BYTES = 16384  # broadcast_object's first message: a step's plan fits it


@dataclass(frozen=True)
class TPShard:
    """Which share of the model a rank holds: rank `rank` of `size`."""

    rank: int = 0
    size: int = 1

    def split(self, n: int) -> tuple[int, int]:
        """(start, count) of this rank's equal part of `n` (n divisible by size)."""
        count = n // self.size
        return self.rank * count, count

    def kv_heads(self, num_kv_heads: int) -> tuple[int, int]:
        """(first, count) of this rank's kv heads: an equal part, or one head replicated on
        size / num_kv_heads ranks when there are fewer kv heads than ranks."""
        if self.size <= num_kv_heads:
            return self.split(num_kv_heads)
        return self.rank // (self.size // num_kv_heads), 1

    def vocab(self, vocab_size: int) -> tuple[int, int]:
        """(first token id, rows) of this rank's vocabulary part: the vocabulary is padded
        to a multiple of size; rows past `vocab_size` are zero padding."""
        rows = -(-vocab_size // self.size)
        return self.rank * rows, rows


SINGLE = TPShard()
_comm_device = torch.device("cpu")  # where the runner's small collectives' tensors live (NCCL: the GPU)
_shm: ShmComm | None = None  # CPU ranks: shared-memory collectives for what fits (engine/distributed/shm.py)


def init_group(shard: TPShard, port: int, device: str, shm: ShmHandle | None = None) -> None:
    """Join the group as `shard.rank`. With `shm` (CPU ranks; rank 0 made it), collectives
    that fit its slots go through shared memory, the rest through gloo."""
    global _comm_device, _shm
    _comm_device = torch.device(device)
    if shm is not None and not device.startswith("cuda"):
        _shm = ShmComm(shm, shard.rank)  # mapped before the group forms, so rank 0 may unlink it after
    backend, options = ("nccl", None) if device.startswith("cuda") else ("gloo", _gloo_options())
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=shard.rank,
                            world_size=shard.size, timeout=COLLECTIVE_TIMEOUT, pg_options=options)
    if _shm is not None:
        dist.barrier()  # every rank has mapped the file
        if shard.rank == 0:
            _shm.unlink()


def _gloo_options():
    """One gloo worker thread instead of two: our collectives run one at a time, and each
    thread hand-off costs a wake-up. On our 2-vCPU VMs a [8, 64] all-reduce between two
    processes took 480 us instead of 740 (a raw TCP round trip: 16 us). The option is private
    to torch; without it, gloo's defaults."""
    try:
        options = dist.ProcessGroupGloo._Options()
        options._threads = 1
        return options
    except AttributeError:
        return None


def destroy_group() -> None:
    global _shm
    _shm = None
    if dist.is_initialized():
        dist.destroy_process_group()


def all_reduce(x: torch.Tensor, shard: TPShard) -> torch.Tensor:
    """Sum of `x` over the ranks (in place)."""
    if shard.size > 1 and not (_shm is not None and _shm.all_reduce(x)):
        dist.all_reduce(x)
    return x


def all_reduce_min(value: int, shard: TPShard) -> int:
    if shard.size == 1:
        return value
    t = torch.tensor([value], dtype=torch.long, device=_comm_device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())


def gather_vocab(x: torch.Tensor, shard: TPShard, vocab_size: int) -> torch.Tensor | None:
    """Each rank's [T, rows] logits -> rank 0's [T, vocab_size] (padding trimmed); None
    on the other ranks."""
    if shard.size == 1:
        return x[..., :vocab_size] if x.shape[-1] != vocab_size else x
    x = x.contiguous()
    parts = _shm.gather(x) if _shm is not None else False
    if parts is False:
        parts = [torch.empty_like(x) for _ in range(shard.size)] if shard.rank == 0 else None
        dist.gather(x, parts, dst=0)
    return None if parts is None else torch.cat(parts, dim=-1)[..., :vocab_size]


def broadcast_object(obj: object, shard: TPShard) -> object:
    """Rank 0's `obj` on every rank, pickled. A step's plan (a few hundred bytes to a few KB)
    fits the fixed-size first broadcast, so it costs one collective: on gloo each costs far
    more in latency than in bytes. A larger one sends its remainder in a second broadcast."""
    if _shm is not None:
        return _broadcast_shm(obj, shard)
    head = torch.zeros(BROADCAST_BYTES, dtype=torch.uint8)
    if shard.rank == 0:
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        head[:8] = torch.tensor([len(data)], dtype=torch.int64).view(torch.uint8)
        first = min(len(data), BROADCAST_BYTES - 8)
        head[8:8 + first] = torch.frombuffer(bytearray(data[:first]), dtype=torch.uint8)
    head = head.to(_comm_device)
    dist.broadcast(head, src=0)
    if shard.rank == 0:
        if len(data) > BROADCAST_BYTES - 8:
            dist.broadcast(torch.frombuffer(bytearray(data[first:]), dtype=torch.uint8).to(_comm_device), src=0)
        return obj
    head = head.cpu()
    size = int(head[:8].view(torch.int64).item())
    data = head[8:8 + size].numpy().tobytes()
    if size > BROADCAST_BYTES - 8:
        rest = torch.empty(size - len(data), dtype=torch.uint8, device=_comm_device)
        dist.broadcast(rest, src=0)
        data += rest.cpu().numpy().tobytes()
    return pickle.loads(data)


def _broadcast_shm(obj: object, shard: TPShard) -> object:
    """broadcast_object through the shared slot; what does not fit follows over gloo."""
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL) if shard.rank == 0 else None
    first, size = _shm.broadcast_bytes(data)
    if size > len(first):
        if shard.rank == 0:
            dist.broadcast(torch.frombuffer(bytearray(data[len(first):]), dtype=torch.uint8), src=0)
        else:
            rest = torch.empty(size - len(first), dtype=torch.uint8)
            dist.broadcast(rest, src=0)
            first += rest.numpy().tobytes()
    return obj if shard.rank == 0 else pickle.loads(first)
