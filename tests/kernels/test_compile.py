"""Every kernel instantiation compiles with NVRTC, without a GPU: PTX for sm_80, and a
cubin for sm_90 through ptxas, whose report must show no spills. No warnings either.
Skips where cupy or NVRTC is absent (CI); runs wherever `pip install cupy-cuda12x
nvidia-cuda-nvrtc-cu12` was done (about 4.5 minutes of CPU time since the fp8 cache's
instantiations joined: 10 minutes on two busy cores, 2026-11-30)."""

from __future__ import annotations

import re

import pytest

from cupy_kernels import compile as kc


def _nvrtc_reason() -> str | None:
    try:
        from cupy_backends.cuda.libs import nvrtc
        nvrtc.getVersion()
    except Exception as e:  # ImportError, or NVRTC's shared library missing
        return f"cupy/NVRTC not available: {type(e).__name__}: {e}"
    return None


pytestmark = pytest.mark.skipif(_nvrtc_reason() is not None, reason=str(_nvrtc_reason()))


def _functions(log: str) -> dict[str, list[str]]:
    """ptxas -v report lines, by kernel (mangled name)."""
    report: dict[str, list[str]] = {}
    current = None
    for line in log.splitlines():
        found = re.search(r"(?:Compiling entry function|Function properties for) '?(\w+)'?", line)
        if found:
            current = found.group(1)
            report.setdefault(current, [])
        elif current:
            report[current].append(line)
    return report


@pytest.mark.parametrize("arch", ["compute_80", "sm_90"])
@pytest.mark.parametrize("source", kc.SOURCES)
def test_all_instantiations_compile(source, arch):
    exprs = kc.all_instantiations()[source]
    binary, log = kc.compile_for_arch(source, exprs, arch)
    assert binary
    assert "warning" not in log.lower(), log
    if arch.startswith("sm_"):
        report = _functions(log)
        assert len(report) == len(exprs), f"ptxas reported {len(report)} kernels for {len(exprs)} names"
        spills = {name: lines for name, lines in report.items()
                  if any("spill" in line and not re.search(r"\b0 bytes spill stores, 0 bytes spill loads", line)
                         for line in lines)}
        assert not spills, f"register spills: {spills}"
