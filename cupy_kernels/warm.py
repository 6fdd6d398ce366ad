"""Compile every kernel instantiation for this machine's GPU, in parallel processes, into
CuPy's on-disk kernel cache, so that later processes load them instead of compiling
one by one on first use (NVRTC takes about a second per instantiation).

    python -m cupy_kernels.warm [--jobs N]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context


def _compile(job: tuple[str, str]) -> str:
    from cupy_kernels import compile as kc
    kc.get_kernel(*job, 0)
    return job[1]


def warm(jobs: int) -> int:
    from cupy_kernels import compile as kc
    work = [(source, expr) for source, exprs in kc.all_instantiations().items() for expr in exprs]
    start = time.perf_counter()
    # spawn, not fork: each worker opens its own CUDA context.
    with ProcessPoolExecutor(jobs, mp_context=get_context("spawn")) as pool:
        for _ in pool.map(_compile, work, chunksize=4):
            pass
    print(f"compiled {len(work)} kernel instantiations in {time.perf_counter() - start:.1f} s with {jobs} processes")
    return len(work)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=min(16, os.cpu_count() or 1), help="worker processes")
    args = parser.parse_args(argv)
    import cupy_kernels
    if not cupy_kernels.available():
        print(f"error: {cupy_kernels.unavailable_reason()}", file=sys.stderr)
        return 1
    warm(args.jobs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
