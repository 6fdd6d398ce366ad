"""CPU kernels in C++ (AVX2/AVX-512 through the compiler), each with a torch reference.

    csrc/         C++ sources: one file per kernel family, each its own torch extension
    compile.py    JIT build on first use (torch.utils.cpp_extension), cached per source,
                  torch version and CPU; the fallback when no compiler works
    ops.py        launchers taking torch CPU tensors
    reference.py  plain-torch float32 references, for the tests
    warm.py       `python -m cpu_kernels.warm`: build everything now (`make setup` runs it)

Mirrors `cupy_kernels/`. Importing this package builds nothing; `available(family)` says
whether a family's kernels built here, and builds them the first time it is asked.
"""

from __future__ import annotations

from cpu_kernels.compile import FAMILIES, available, unavailable_reason

__all__ = ["FAMILIES", "available", "unavailable_reason"]
