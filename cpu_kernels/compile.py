"""JIT-build each kernel family as a torch C++ extension, once per machine.

A family is one `csrc/<family>.cpp` that registers its ops under `torch.ops.pagedserve_cpu`
(TORCH_LIBRARY_FRAGMENT), so no pybind11 module is built. It is compiled with
`-march=native`: the binary fits this CPU only, so the build folder is keyed by the
source text (with csrc/*.h), the torch version and the CPU's instruction-set flags (our VMs differ:
some have AVX-512, some only AVX2). A second process on the same machine loads the
cached library in milliseconds.

Where no compiler works (a slim image, a read-only cache), `available()` returns False
and logs one warning with the reason; the engine then runs the plain-torch paths.
`PAGEDSERVE_CPU_KERNELS=0` turns the kernels off (the tests of that fallback use it).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import threading
from pathlib import Path

CSRC = Path(__file__).resolve().parent / "csrc"
FAMILIES = ("quant_linear", "quant_linear_bf16", "fp8_linear", "paged_attention", "paged_attention_int8", "layer_ops",
            "mxfp4_int8", "int_dot", "int_dot_avx2", "decode_layers")
# -fopenmp: at::parallel_for is inline OpenMP code in torch's headers; without the flag it
# compiles to a serial loop. The OpenMP runtime itself is torch's (libtorch_cpu loads it).
CFLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-fopenmp"]
# Families that must not use AVX-512 where the CPU has it, so that an AVX-512 machine tests the
# instructions an AVX2-only one runs (a target attribute can add instructions, not remove them).
FAMILY_CFLAGS = {"int_dot_avx2": ["-mno-avx512f"]}
_LOCK = threading.Lock()
log = logging.getLogger("pagedserve.cpu_kernels")


def available(family: str) -> bool:
    """Whether `family`'s ops are loaded (building them on first call). Never raises."""
    return unavailable_reason(family) is None


@functools.cache
def unavailable_reason(family: str) -> str | None:
    """Why `family` cannot run here, or None once its ops are registered. The first call
    per family builds or loads it, and logs one warning if it cannot run."""
    if family not in FAMILIES:
        raise ValueError(f"unknown CPU kernel family {family!r} (known: {', '.join(FAMILIES)})")
    reason = _load(family)
    if reason is not None:
        log.warning("CPU kernels %r unavailable, using the plain-torch path: %s", family, reason)
    return reason


def _load(family: str) -> str | None:
    if os.environ.get("PAGEDSERVE_CPU_KERNELS", "1") == "0":
        return "turned off by PAGEDSERVE_CPU_KERNELS=0"
    if platform.machine() not in ("x86_64", "AMD64"):
        return f"the kernels are written for x86-64 (this machine: {platform.machine()})"
    try:
        with _LOCK:
            _build(family)
    except Exception as e:  # a missing compiler or header shows up as assorted errors
        lines = str(e).strip().splitlines()
        return f"{type(e).__name__}: {lines[-1] if lines else ''}"
    return None


def build_dir(family: str) -> Path:
    from common.paths import cache_dir
    import torch
    # The family's source and the headers it may include (csrc/*.h: bf16_tiles.h).
    source = b"".join(path.read_bytes() for path in [CSRC / f"{family}.cpp", *sorted(CSRC.glob("*.h"))])
    key = hashlib.sha256(source + " ".join(_cflags(family)).encode() + torch.__version__.encode()
                         + _cpu_flags().encode()).hexdigest()[:16]
    return cache_dir() / "cpu_kernels" / f"{family}-{key}"


def _build(family: str) -> None:
    import torch
    from torch.utils import cpp_extension
    folder = build_dir(family)
    library = folder / f"pagedserve_{family}.so"
    # The folder's key covers the source and flags, so a finished library there is current:
    # load it without cpp_extension, which would first run the compiler (`$CXX --version`)
    # and so fail on a machine whose cache was warmed but which has no compiler. The lock
    # file exists while another process builds; then wait for it through cpp_extension.
    if library.is_file() and not (folder / "lock").exists():
        try:
            torch.ops.load_library(str(library))
            return
        except OSError:  # a truncated or foreign file: rebuild it
            pass
    folder.mkdir(parents=True, exist_ok=True)
    # is_python_module=False: a plain shared library whose static initialisers register
    # the ops with torch; cpp_extension's file lock serialises concurrent builders.
    cpp_extension.load(name=f"pagedserve_{family}", sources=[str(CSRC / f"{family}.cpp")],
                       extra_cflags=_cflags(family), extra_ldflags=[], build_directory=str(folder),
                       is_python_module=False, verbose=False)


def _cflags(family: str) -> list[str]:
    return CFLAGS + FAMILY_CFLAGS.get(family, [])


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            line = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return ""
    return " ".join(sorted(line.split(":", 1)[-1].split()))
