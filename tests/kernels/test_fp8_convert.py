"""The CUDA kernels' float8_e4m3fn conversion (cupy_kernels/csrc/fp8.cuh), compiled as host C++
with the system compiler, against torch: every byte's value, and rounding of a grid of floats
(every tie between neighbouring codes and the floats either side of it, saturation, subnormals,
float denormals, signed zeros, NaN, random values at many scales) against the fp8 cache's
reference quantizer (engine/attention/kv_format.py). The kernels compile the same text; no GPU
runs here. Skips without a C++ compiler."""

from __future__ import annotations

import ctypes
import shutil
import subprocess

import numpy as np
import pytest
import torch

from cupy_kernels.compile import CSRC
from engine.attention.kv_format import KvCacheFormat

COMPILER = shutil.which("g++") or shutil.which("c++")
pytestmark = pytest.mark.skipif(COMPILER is None, reason="no C++ compiler")

# The CUDA names fp8.cuh uses, for the host: qualifiers vanish, bit casts go through memcpy.
HOST_PRELUDE = """
#include <cmath>
#include <cstring>
#define __device__
#define __forceinline__ inline
static inline unsigned int __float_as_uint(float f) { unsigned int u; std::memcpy(&u, &f, 4); return u; }
static inline float __uint_as_float(unsigned int u) { float f; std::memcpy(&f, &u, 4); return f; }
"""
HOST_ENTRIES = """
extern "C" void encode(const float* x, unsigned char* out, long n) {
  for (long i = 0; i < n; ++i) out[i] = (unsigned char)float_to_fp8_e4m3(x[i]);
}
extern "C" void decode(const unsigned char* b, float* out, long n) {
  for (long i = 0; i < n; ++i) out[i] = fp8_e4m3_to_float(b[i]);
}
"""


@pytest.fixture(scope="module")
def host_fp8(tmp_path_factory):
    folder = tmp_path_factory.mktemp("fp8")
    source = folder / "fp8_host.cpp"
    source.write_text(HOST_PRELUDE + (CSRC / "fp8.cuh").read_text() + HOST_ENTRIES)
    library = folder / "fp8_host.so"
    # -O2 without -ffast-math: IEEE arithmetic, round-to-nearest-even rintf, as on the device.
    subprocess.run([COMPILER, "-O2", "-shared", "-fPIC", "-o", str(library), str(source)], check=True)
    return ctypes.CDLL(str(library))


def encode(lib, x: np.ndarray) -> np.ndarray:
    x = np.ascontiguousarray(x, dtype=np.float32)
    out = np.empty(x.shape, dtype=np.uint8)
    lib.encode(x.ctypes.data_as(ctypes.c_void_p), out.ctypes.data_as(ctypes.c_void_p), ctypes.c_long(x.size))
    return out


def decode(lib, b: np.ndarray) -> np.ndarray:
    b = np.ascontiguousarray(b, dtype=np.uint8)
    out = np.empty(b.shape, dtype=np.float32)
    lib.decode(b.ctypes.data_as(ctypes.c_void_p), out.ctypes.data_as(ctypes.c_void_p), ctypes.c_long(b.size))
    return out


def test_every_byte_decodes_as_torch_does(host_fp8):
    codes = np.arange(256, dtype=np.uint8)
    expected = torch.from_numpy(codes).view(torch.float8_e4m3fn).float().numpy()
    got = decode(host_fp8, codes)
    nan = np.isnan(expected)
    assert nan.sum() == 2 and np.array_equal(np.isnan(got), nan)  # 0x7f and 0xff
    # bitwise, so that -0.0 (0x80) is told from 0.0
    assert np.array_equal(got[~nan].view(np.uint32), expected[~nan].view(np.uint32))


def rounding_grid() -> np.ndarray:
    values = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float().numpy()
    positive = np.sort(values[(values >= 0) & np.isfinite(values)])
    ties = (positive[:-1] + positive[1:]) / 2  # exact in float32: one more bit than e4m3
    near = np.concatenate([ties, np.nextafter(ties, np.inf), np.nextafter(ties, 0), positive])
    edges = np.array([448, 449, 463.99, 464, 465, 479, 480, 1e4, 3e38, np.inf, 2.0 ** -6, 2.0 ** -9,
                      2.0 ** -10, 2.0 ** -10 * 1.0001, 2.0 ** -11, 1e-30, 1e-40, 1.4e-45, 0.0], dtype=np.float32)
    gen = np.random.default_rng(0)
    scales = np.float32(2.0) ** gen.integers(-14, 10, 20000).astype(np.float32)
    randoms = gen.standard_normal(20000).astype(np.float32) * scales
    grid = np.concatenate([near, edges, randoms]).astype(np.float32)
    return np.concatenate([grid, -grid])


def test_rounding_matches_the_cache_convention(host_fp8):
    x = rounding_grid()
    expected = KvCacheFormat("fp8", torch.bfloat16).quantize_rows(torch.from_numpy(x)).view(torch.uint8).numpy()
    got = encode(host_fp8, x)
    bad = np.flatnonzero(got != expected)
    assert bad.size == 0, [(float(x[i]), hex(got[i]), hex(expected[i])) for i in bad[:10]]
    assert np.array_equal(decode(host_fp8, got), decode(host_fp8, expected))


def test_nan_stays_nan_with_its_sign(host_fp8):
    nans = np.array([np.nan, -np.nan], dtype=np.float32)
    expected = torch.from_numpy(nans).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
    assert np.array_equal(encode(host_fp8, nans), expected)
    assert np.isnan(decode(host_fp8, encode(host_fp8, nans))).all()
