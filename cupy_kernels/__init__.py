"""CUDA paged-attention kernels compiled with CuPy (NVRTC), each with a torch reference.

    csrc/       CUDA C++ sources, read at run time (common.cuh + one .cu per kernel family)
    compile.py  template instantiations, lazy compilation, the GPU-less NVRTC check
    ops.py      launchers taking torch CUDA tensors
    reference.py  plain-torch float32 references, for the tests

Importing this package imports neither cupy nor CUDA, so CPU-only installs work;
`available()` says whether the kernels can run here.
"""

from __future__ import annotations

import functools

MIN_COMPUTE_CAPABILITY = (8, 0)  # cp.async and bf16


@functools.cache
def available() -> bool:
    """True if cupy imports, torch sees a CUDA device, and it is sm_80 or newer. Never raises."""
    return unavailable_reason() is None


@functools.cache
def unavailable_reason() -> str | None:
    """Why the kernels cannot run here, or None if they can."""
    try:
        import torch
        if not torch.cuda.is_available():
            return "no CUDA device visible to torch"
        import cupy
        if cupy.cuda.runtime.getDeviceCount() == 0:
            return "cupy sees no CUDA device"
        if torch.cuda.get_device_capability() < MIN_COMPUTE_CAPABILITY:
            return f"compute capability {torch.cuda.get_device_capability()} < 8.0"
    except ImportError as e:
        return f"cannot import {e.name or e}: install the gpu extra (cupy)"
    except Exception as e:  # a broken driver or runtime surfaces as assorted errors
        return f"CUDA unavailable: {type(e).__name__}: {e}"
    return None
