"""Which quantized-linear kernel, dtype and thread count this machine runs, by measurement.

Our VMs (and users' machines) differ: AMD Zen 4 with AVX512-BF16, Intel with AMX, AVX2
only. A rule written on one of them ("bf16 wherever AVX512-BF16 is") was wrong on another,
so the choice is timed: the first time an engine loads a model of given layer shapes on a
machine (or `make setup`'s warm step, for the bundled model), each candidate runs the
model's linear shapes at a mix of row counts, and the fastest wins. The result is cached
next to the compiled kernels, keyed by the CPU's flags, torch, the kernels' sources, the
shapes and the thread budget, so a second start reads it in a millisecond.

Candidates (those this CPU and build run):
  amx          bf16 activations, AMX tiles from 16 rows on, AMX arithmetic below that
               (csrc/quant_linear_bf16.cpp: one arithmetic for every row count)
  avx512_bf16  bf16 activations, VDPBF16PS throughout
  float32      float32 activations (csrc/quant_linear.cpp)
The score is the geometric mean, over the model's shapes and the row counts (1, 8, 64,
512), of the time per row: one decoding stream, a small batch, a big batch's decode step and
a prefill chunk each weigh the same in relative terms (a sum would let the one-row times,
the largest per row, decide alone). The thread counts tried are the budget
and one fewer (the frontend and the tokenizer share the cores); ties (within 3%) go to more
threads. Each kernel is batch invariant under its own arithmetic, and the choice never
depends on the batch: it is made once per process.

`PAGEDSERVE_CPU_ARITHMETIC=amx|avx512_bf16|float32` skips the measurement and takes that
kernel (where this CPU runs it): to compare them, or to pin one across a fleet.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import json
import logging
import math
import os
import time
from pathlib import Path

ENV = "PAGEDSERVE_CPU_ARITHMETIC"
ROW_MIX = (1, 8, 64, 512)
# The bundled SmolLM2-135M's layers (qkv, o, gate_up, down; N x K): what `--dtype auto`
# is decided on, once per machine (the dtype is the whole model's: attention, norms, KV).
DEFAULT_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
TIE = 0.03  # a fewer-threads candidate must win by more than this
ROTATE_BYTES = 64 << 20  # each shape's weight copies together: past the L2 and L3 of our VMs
log = logging.getLogger("pagedserve.cpu_kernels")


@dataclasses.dataclass(frozen=True)
class KernelPlan:
    arithmetic: str  # "amx" | "avx512_bf16" | "float32"
    threads: int
    scores_us: dict[str, float]  # candidate -> geometric mean of microseconds per row (ROW_MIX x shapes)
    shapes: list[tuple[int, int]]
    measured_at: str

    @property
    def dtype(self) -> str:
        """What `--dtype auto` means on this machine for these shapes."""
        return "float32" if self.arithmetic == "float32" else "bfloat16"

    @property
    def amx(self) -> bool:
        return self.arithmetic == "amx"

    def reason(self) -> str:
        """One line: what won and by how much."""
        if not self.scores_us:
            return f"{self.arithmetic} with {self.threads} threads ({self.measured_at})"
        ranked = sorted(self.scores_us.items(), key=lambda kv: kv[1])
        best = ranked[0][1]
        others = ", ".join(f"{name} {score / best:.2f}x slower" for name, score in ranked[1:])
        return (f"{self.arithmetic} with {self.threads} threads: {best:.2f} us per row (geometric mean over rows "
                f"{'/'.join(map(str, ROW_MIX))} and the model's {len(self.shapes)} layer shapes)"
                + (f"; {others}" if others else ""))


def machine_plan() -> KernelPlan | None:
    """The plan for the bundled model's shapes with this process's thread budget: what
    `--dtype auto` means on this machine (engine/config.resolve_dtype)."""
    from common.process_args import default_num_threads
    return plan(DEFAULT_SHAPES, default_num_threads())


def candidates() -> list[str]:
    from cpu_kernels import ops
    from cpu_kernels.compile import available
    out = []
    if ops.bf16_amx_ready():
        out.append("amx")
    if ops.bf16_dot_supported():
        out.append("avx512_bf16")
    if available("quant_linear"):
        out.append("float32")
    return out


def plan(shapes: list[tuple[int, int]], threads: int) -> KernelPlan | None:
    """The measured plan for linear layers of `shapes` ([(N, K)], K a multiple of 32) with
    at most `threads` threads; None where no quantized kernel runs here. Cached on disk; the
    first call per machine and shapes measures (about a second), under a file lock so that
    processes starting together measure once."""
    names = candidates()
    if not names:
        return None
    shapes = sorted({(int(n), int(k)) for n, k in shapes if k % 32 == 0})
    if not shapes:
        return None
    forced = os.environ.get(ENV)
    if forced:
        if forced not in names:
            raise ValueError(f"{ENV}={forced!r}: this CPU runs {', '.join(names)}")
        return KernelPlan(forced, threads, {}, shapes, f"set by {ENV}")
    path = _cache_path(shapes, threads, names)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(str(path) + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        cached = _read(path)
        if cached is not None:
            return cached
        result = measure(shapes, threads, names)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(dataclasses.asdict(result), indent=1))
        tmp.replace(path)
    log.info("CPU kernel plan: %s", result.reason())
    return result


def measure(shapes: list[tuple[int, int]], threads: int, names: list[str]) -> KernelPlan:
    """Time each candidate at `threads`, then the winner at one thread fewer."""
    import torch
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        scores = {name: _score(name, shapes) for name in names}
        best = min(scores, key=scores.get)
        chosen_threads = threads
        if threads > 1:
            torch.set_num_threads(threads - 1)
            fewer = _score(best, shapes)
            scores[f"{best}@{threads - 1}threads"] = fewer
            if fewer < scores[best] * (1 - TIE):
                chosen_threads = threads - 1
    finally:
        torch.set_num_threads(previous)
    return KernelPlan(best, chosen_threads, {k: round(v, 3) for k, v in scores.items()}, shapes,
                      time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))


def _score(name: str, shapes: list[tuple[int, int]]) -> float:
    """The geometric mean of microseconds per row over ROW_MIX and the shapes (medians of a
    few calls each).
    Calls rotate over copies of each weight that together exceed the caches, as a model's
    layers do: in cache, a kernel that does more arithmetic per weight looks better than it is."""
    import torch

    from cpu_kernels import ops, packing
    from cpu_kernels.quant_format import quantize
    logs = []
    generator = torch.Generator().manual_seed(0)
    for n, k in shapes:
        weight = quantize(torch.randn(n, k, generator=generator) * 0.05, "int4")
        if name == "float32":
            base = (weight.qweight, weight.scales, weight.zeros)
        else:
            base = (packing.pack(weight).data,)
        nbytes = sum(t.numel() * t.element_size() for t in base)
        copies = [tuple(t.clone() for t in base) for _ in range(min(256, max(2, ROTATE_BYTES // nbytes)))]
        for m in ROW_MIX:
            x = torch.randn(m, k, generator=generator)
            xb, amx, turn = x.bfloat16(), name == "amx", iter(range(1 << 62))
            if name == "float32":
                def call(x=x):
                    qweight, scales, zeros = copies[next(turn) % len(copies)]
                    ops.int4_linear(x, qweight, scales, zeros)
            else:
                def call(xb=xb, amx=amx):
                    ops.bf16_quant_linear(xb, "int4", copies[next(turn) % len(copies)][0], n, amx)
            logs.append(math.log(_median_seconds(call) * 1e6 / m))
    return math.exp(sum(logs) / len(logs))


def _median_seconds(call, budget_s: float = 0.02, most: int = 50) -> float:
    call()  # warm: first-touch of buffers, thread pool start
    times = []
    deadline = time.perf_counter() + budget_s
    while len(times) < 3 or (time.perf_counter() < deadline and len(times) < most):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    times.sort()
    return times[len(times) // 2]


def _cache_path(shapes: list[tuple[int, int]], threads: int, names: list[str]) -> Path:
    import torch

    from common.paths import cache_dir
    from cpu_kernels.compile import CSRC, _cpu_flags
    sources = b"".join((CSRC / f"{family}.cpp").read_bytes() for family in ("quant_linear", "quant_linear_bf16"))
    key = hashlib.sha256(sources + Path(__file__).read_bytes() + torch.__version__.encode() + _cpu_flags().encode()
                         + json.dumps([shapes, threads, names]).encode()).hexdigest()[:16]
    return cache_dir() / "cpu_kernels" / f"plan-{key}.json"


def _read(path: Path) -> KernelPlan | None:
    with contextlib.suppress(OSError, ValueError, TypeError, KeyError):
        data = json.loads(path.read_text())
        data["shapes"] = [tuple(s) for s in data["shapes"]]
        return KernelPlan(**data)
    return None
