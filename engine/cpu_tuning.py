"""Process-wide CPU settings for the engine: threads, denormals, and the allocator.

glibc returns freed heap memory to the OS and serves big blocks with fresh mmaps, so
after one large prefill every decode step page-faults its temporaries back in (we
measured single-request decode falling from ~53 to ~45 tok/s after a 64-prompt batch).
Keeping freed memory in the heap, as tcmalloc would, removes that; vLLM's CPU backend
preloads tcmalloc for the same reason.

bf16 matmuls run on oneDNN, which JIT-builds a kernel per distinct shape and keeps up to
1,024 of them (about 1 MiB each). A step's token count, batch size and context width
change every step, so a long-running engine kept building kernels (about 1 ms each, a
step's worth of time at small batches) and its RSS grew for half an hour (+12% in a 30-
minute soak). `bucket` rounds those sizes up so that few shapes exist: the runner and
the torch attention backend pad to it on CPU.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

import torch

from common.process_args import default_num_threads

log = logging.getLogger("pagedserve.engine")

_M_TRIM_THRESHOLD = -1  # from glibc's malloc.h
_M_MMAP_THRESHOLD = -3
_KEEP_BYTES = 1 << 30


def bucket(n: int) -> int:
    """`n` rounded up to one of at most 8 sizes per power of two (exact up to 16): padding
    costs at most 1/8 more work, and sizes up to 8k fall into about 80 buckets."""
    if n <= 16:
        return n
    step = 1 << (n.bit_length() - 4)
    return (n + step - 1) // step * step


def linear_shapes(arch) -> list[tuple[int, int]]:
    """A decoder's linear layers as (N, K), fused as our models fuse them: qkv, o, gate_up, down."""
    q, kv = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    inter = arch.intermediate_size or arch.moe_intermediate_size
    return [(q + 2 * kv, arch.hidden_size), (arch.hidden_size, q), (2 * inter, arch.hidden_size),
            (arch.hidden_size, inter)]


def tune_cpu(num_threads: int | None) -> None:
    torch.set_flush_denormal(True)  # denormals make some models 5x slower on CPU
    torch.set_num_threads(num_threads or default_num_threads())
    _keep_freed_memory()


def _keep_freed_memory() -> None:
    name = ctypes.util.find_library("c")
    if name is None:
        return
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to tune
        return
    if not (mallopt(_M_MMAP_THRESHOLD, _KEEP_BYTES) and mallopt(_M_TRIM_THRESHOLD, _KEEP_BYTES)):
        log.debug("mallopt refused the allocator settings; continuing without them")
