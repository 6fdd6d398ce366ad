"""How many blocks the KV pool gets. The first flag given wins:

1. `num_kv_blocks`: that many;
2. `gpu_memory_utilization` F (CUDA only, as vLLM reads it): the engine may use F of the GPU's
   total memory for weights, activations and the KV cache, so the pool gets
   F * total - weights - the peak activations of the largest step (max_num_batched_tokens
   tokens, profiled once before the pool exists);
3. `kv_cache_memory_gb`: that many GiB.

The arithmetic is plain ints (`blocks_for_gpu_share`); only `measure_gpu_memory` touches a GPU.
Not in the sum, as in vLLM before it profiled them: the CUDA context, CUDA graphs (captured
after the pool), LoRA slots and a draft model. F below 1 (vLLM's default is 0.9) leaves them room.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass

from engine.config import EngineConfig
from engine.step_rows import ForwardRow

GiB = 2**30
MiB = 2**20
log = logging.getLogger("pagedserve.engine")


@dataclass(frozen=True)
class GpuMemory:
    """One GPU's memory as the engine starts, in bytes."""

    total_bytes: int  # the device's whole memory
    free_bytes: int  # free now, after the weights and the profiled step (other processes hold the rest)
    weights_bytes: int  # what this process holds before the KV pool: the weights
    activation_bytes: int  # the peak a step of max_num_batched_tokens adds on top


def num_kv_blocks(config: EngineConfig, bytes_per_block: int, measure: Callable[[], GpuMemory]) -> int:
    """The pool's size by the flags' precedence (the module docstring); `measure` is called
    only where gpu_memory_utilization decides."""
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks
    if config.gpu_memory_utilization is not None:  # config validation allows it on CUDA only
        return blocks_for_gpu_share(measure(), config.gpu_memory_utilization, bytes_per_block)
    return max(1, int(config.kv_cache_memory_gb * GiB) // bytes_per_block)


def blocks_for_gpu_share(memory: GpuMemory, share: float, bytes_per_block: int) -> int:
    """The blocks that fit in `share` of the GPU once the weights and activations are counted.
    ValueError, naming the numbers and what to change, where not one block fits, or where
    the pool would need more than is free."""
    budget = int(memory.total_bytes * share)
    used = memory.weights_bytes + memory.activation_bytes
    kv_bytes = budget - used
    if kv_bytes < bytes_per_block:
        raise ValueError(
            f"gpu_memory_utilization {share}: {_gib(budget)} of the GPU's {_gib(memory.total_bytes)} leaves no "
            f"room for the KV cache after the weights ({_gib(memory.weights_bytes)}) and a step's activations "
            f"({_gib(memory.activation_bytes)}); a block needs {bytes_per_block / MiB:.2f} MiB: raise "
            "--gpu-memory-utilization, lower --max-num-batched-tokens, or shrink the weights (--quantization "
            "int8 or int4, or a smaller model)")
    if kv_bytes > memory.free_bytes:
        most = math.floor(100 * (used + memory.free_bytes) / memory.total_bytes) / 100
        raise ValueError(
            f"gpu_memory_utilization {share}: the KV cache would take {_gib(kv_bytes)} but only "
            f"{_gib(memory.free_bytes)} of the GPU is free (another process holds the rest); use "
            f"--gpu-memory-utilization {most:.2f} or less, or free the GPU")
    num_blocks = kv_bytes // bytes_per_block
    log.info("gpu_memory_utilization %s of %s = %s: weights %s, activations %s, KV cache %s -> %d blocks of "
             "%.2f MiB", share, _gib(memory.total_bytes), _gib(budget), _gib(memory.weights_bytes),
             _gib(memory.activation_bytes), _gib(kv_bytes), num_blocks, bytes_per_block / MiB)
    return num_blocks


def profile_rows(num_tokens: int, max_model_len: int, block_size: int) -> list[ForwardRow]:
    """The largest step the scheduler can make: `num_tokens` prompt tokens in sequences of at
    most `max_model_len`, each with its own blocks (numbered from 0) and its last row's logits."""
    rows, first_block = [], 0
    while num_tokens > 0:
        n = min(num_tokens, max_model_len)
        num_blocks = -(-n // block_size)
        rows.append(ForwardRow([0] * n, 0, list(range(first_block, first_block + num_blocks)), 1))
        first_block += num_blocks
        num_tokens -= n
    return rows


def num_profile_blocks(rows: list[ForwardRow]) -> int:
    return sum(len(r.block_ids) for r in rows)


def measure_gpu_memory(device, allocate_scratch: Callable[[], object], step: Callable[[object], None]) -> GpuMemory:
    """What this process holds on `device` now (the weights), and the peak that `step` adds,
    given the scratch KV cache that `allocate_scratch` makes for it (not counted: the pool
    replaces it)."""
    import torch
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    weights = torch.cuda.memory_allocated(device)
    scratch = allocate_scratch()
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    step(scratch)
    torch.cuda.synchronize(device)
    activations = torch.cuda.max_memory_allocated(device) - base
    del scratch
    torch.cuda.empty_cache()  # the step's blocks go back to the GPU, for the pool
    free, total = torch.cuda.mem_get_info(device)
    return GpuMemory(total, free, weights, activations)


def _gib(num_bytes: int) -> str:
    return f"{num_bytes / GiB:.2f} GiB"
