"""CUDA sources, the template instantiations we use, and their lazy NVRTC compilation.

Kernels are C++ templates; NVRTC instantiates the ones named in `name_expressions`,
e.g. `paged_decode<bf16_t, 128, 16, 8, false>`. Each (source, instantiation, device)
compiles once per process on first use (and CuPy caches the binary on disk). CuPy
picks the target from the device: `-arch=sm_90` on Hopper, otherwise the device's own
architecture, or PTX for the newest one NVRTC knows when the device is newer still.

`compile_for_arch` compiles without a GPU, through NVRTC directly, for the check in
tests/kernels/test_compile.py.
"""

from __future__ import annotations

import functools
from pathlib import Path

CSRC = Path(__file__).resolve().parent / "csrc"
OPTIONS = ("-std=c++17",)
CUPY_ADDS = ("-ftz=true", "--device-as-default-execution-space")  # what RawModule adds at run time
CTYPES = {"float32": "float", "float16": "half_t", "bfloat16": "bf16_t"}
HEAD_SIZES = (64, 96, 128)
BLOCK_SIZES = (16, 32)
GROUP_TILES = (1, 2, 4, 8)  # query heads per decode CTA; larger groups take several CTAs
SOURCES = ("cache", "decode", "decode_mma", "prefill", "layers")
MMA_DTYPES = ("float16", "bfloat16")  # the tensor-core decode (decode_mma.cu) has no fp32 path
# --kv-cache-dtype fp8: the cache's element type, and the model dtypes whose kernels read it
# (an fp8 cache is widened to the model's dtype as it is staged: every dtype, exactly).
FP8 = "float8_e4m3fn"
KV_CTYPES = {FP8: "fp8_e4m3_t"}
FP8_MODEL_DTYPES = tuple(CTYPES)
LAYER_KERNELS = ("rms_norm", "add_rms_norm", "rotary", "silu_and_mul")


@functools.cache
def source(name: str) -> str:
    """fp8.cuh + common.cuh + <name>.cu as one text: CuPy's disk cache keys on the text, so an
    edit to a shared header must change it (an #include would not)."""
    return "\n".join((CSRC / f).read_text() for f in ("fp8.cuh", "common.cuh", f"{name}.cu"))


def _kv(kv_dtype: str | None) -> str:
    """The trailing cache-type template argument: none for a cache in the model's dtype."""
    return "" if kv_dtype is None else f", {KV_CTYPES[kv_dtype]}"


def cache_expr(dtype: str | None = None, kv_dtype: str | None = None) -> str:
    """The byte-moving write for a cache in the model's dtype (any dtype); the quantizing
    one, templated on the model's dtype, for an fp8 cache."""
    return "reshape_and_cache" if kv_dtype is None else f"reshape_and_cache_fp8<{CTYPES[dtype]}>"


def decode_expr(dtype: str, head_size: int, block_size: int, heads_per_cta: int, split: bool,
                kv_dtype: str | None = None) -> str:
    return (f"paged_decode<{CTYPES[dtype]}, {head_size}, {block_size}, {heads_per_cta}, "
            f"{'true' if split else 'false'}{_kv(kv_dtype)}>")


def decode_mma_expr(dtype: str, head_size: int, block_size: int, split: bool, kv_dtype: str | None = None) -> str:
    return (f"paged_decode_mma<{CTYPES[dtype]}, {head_size}, {block_size}, {'true' if split else 'false'}"
            f"{_kv(kv_dtype)}>")


def reduce_expr(dtype: str, head_size: int) -> str:
    return f"paged_decode_reduce<{CTYPES[dtype]}, {head_size}>"


def prefill_expr(dtype: str, head_size: int, block_size: int, kv_dtype: str | None = None) -> str:
    return f"paged_prefill<{CTYPES[dtype]}, {head_size}, {block_size}{_kv(kv_dtype)}>"


def layer_expr(kernel: str, dtype: str) -> str:
    return f"{kernel}<{CTYPES[dtype]}>"


def all_instantiations() -> dict[str, list[str]]:
    """Every instantiation the launchers can ask for, by source file (fp8 caches' included)."""
    decode, decode_mma, prefill = [], [], []
    cache = [cache_expr()] + [cache_expr(dtype, FP8) for dtype in FP8_MODEL_DTYPES]
    for dtype in CTYPES:
        kv_dtypes = (None, FP8) if dtype in FP8_MODEL_DTYPES else (None,)
        for d in HEAD_SIZES:
            decode.append(reduce_expr(dtype, d))  # reads the float32 partials: any cache
            for bs, kv in ((bs, kv) for bs in BLOCK_SIZES for kv in kv_dtypes):
                prefill.append(prefill_expr(dtype, d, bs, kv))
                decode += [decode_expr(dtype, d, bs, g, split, kv) for g in GROUP_TILES for split in (False, True)]
                if dtype in MMA_DTYPES:
                    decode_mma += [decode_mma_expr(dtype, d, bs, split, kv) for split in (False, True)]
    layers = [layer_expr(k, dtype) for k in LAYER_KERNELS for dtype in CTYPES]
    return {"cache": cache, "decode": decode, "decode_mma": decode_mma, "prefill": prefill, "layers": layers}


@functools.cache
def get_kernel(source_name: str, expr: str, device_index: int):
    """The compiled kernel (a cupy.RawKernel) for one instantiation on one device."""
    import cupy
    with cupy.cuda.Device(device_index):
        module = cupy.RawModule(code=source(source_name), options=OPTIONS, name_expressions=(expr,))
        kernel = module.get_function(expr)
        kernel.compile()  # now, not inside a CUDA-graph capture
    return kernel


def compile_for_arch(source_name: str, exprs: list[str], arch: str) -> tuple[bytes, str]:
    """Compile `exprs` of one source with NVRTC for `arch` ("sm_90": cubin through ptxas,
    "compute_90": PTX). Needs NVRTC only, no GPU. Returns (binary, log); the log holds
    ptxas's resource report for sm_ targets (registers, spills) and any warnings."""
    from cupy_backends.cuda.libs import nvrtc
    prog = nvrtc.createProgram(source(source_name), f"{source_name}.cu", (), ())
    try:
        for expr in exprs:
            nvrtc.addNameExpression(prog, expr)
        options = (*OPTIONS, *CUPY_ADDS, f"-arch={arch}")
        if arch.startswith("sm_"):
            options += ("--ptxas-options=-v",)
        try:
            nvrtc.compileProgram(prog, options)
        except nvrtc.NVRTCError as e:
            raise RuntimeError(f"{source_name}.cu ({arch}):\n{nvrtc.getProgramLog(prog)}") from e
        log = nvrtc.getProgramLog(prog)
        binary = nvrtc.getCUBIN(prog) if arch.startswith("sm_") else nvrtc.getPTX(prog)
        return binary, log
    finally:
        nvrtc.destroyProgram(prog)
