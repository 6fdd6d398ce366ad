"""Module-level skip for GPU kernel tests: `from gpu_skip import pytestmark` first thing."""

from __future__ import annotations

import pytest

import cupy_kernels

if not cupy_kernels.available():
    pytest.skip(f"GPU kernels unavailable: {cupy_kernels.unavailable_reason()}", allow_module_level=True)

pytestmark = pytest.mark.gpu
