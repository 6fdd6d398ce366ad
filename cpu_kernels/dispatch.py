"""Which quantized-linear kernel, dtype and thread count this machine runs, by measurement.

Our VMs (and users' machines) differ: AMD Zen 4 with AVX512-BF16, Intel with AMX, AVX2
only. A rule written on one of them ("bf16 wherever AVX512-BF16 is") was wrong on another,
so the choice is timed: the first time an engine loads a model of given layer shapes on a
machine (or `make setup`'s warm step, for the bundled model), each candidate runs the
model's linear shapes at a mix of row counts, and the fastest wins. The result is cached
next to the compiled kernels, keyed by the CPU's flags, torch, the kernels' sources, the
shapes and the thread budget, so a second start reads it in a millisecond.

Candidates (those this CPU and build run):
  amx          bf16 activations, AMX tiles from 2 rows on over bf16-dequantized weights, the
               same arithmetic at one row (csrc/quant_linear_bf16.cpp)
  avx512_bf16  bf16 activations, VDPBF16PS throughout
  float32      float32 activations (csrc/quant_linear.cpp)
The score is the geometric mean, over the model's shapes and the row counts (1, 8, 64,
512), of the time per row: one decoding stream, a small batch, a big batch's decode step and
a prefill chunk each weigh the same in relative terms (a sum would let the one-row times,
the largest per row, decide alone). The thread counts tried are the budget
and one fewer (the frontend and the tokenizer share the cores); ties (within 3%) go to more
threads. All candidates are timed call by call in turn, so that a load that comes and goes
(another process; the test suite's parallel workers) slows them alike. Each kernel is batch invariant under its own arithmetic, and the choice never
depends on the batch: it is made once per process.

`PAGEDSERVE_CPU_ARITHMETIC=amx|avx512_bf16|float32` skips the measurement and takes that
kernel (where this CPU runs it): to compare them, or to pin one across a fleet. A plan
measured while the machine was busy stays cached: `python -m cpu_kernels.warm --remeasure`
measures again.
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
# About 2 s on a quiet 2-core VM; on a busy one the threads wait on each other and one case
# can take seconds: past this, each remaining case is timed once.
PATIENCE_S = 15.0
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
        fewer = f"{self.arithmetic}@{self.threads}threads"  # the winner at fewer threads than the budget
        key = fewer if fewer in self.scores_us else self.arithmetic
        best = self.scores_us[key]
        ranked = sorted(((k, v) for k, v in self.scores_us.items() if k != key), key=lambda kv: kv[1])
        others = ", ".join(f"{name} {score / best:.2f}x" for name, score in ranked)
        return (f"{self.arithmetic} with {self.threads} threads: {best:.2f} us per row (geometric mean over rows "
                f"{'/'.join(map(str, ROW_MIX))} and the model's {len(self.shapes)} layer shapes)"
                + (f"; time per row of the others: {others}" if others else ""))


def forget() -> int:
    """Delete every cached plan (the next start measures again); returns how many."""
    from common.paths import cache_dir
    paths = list((cache_dir() / "cpu_kernels").glob("plan-*.json"))
    for path in paths:
        path.unlink(missing_ok=True)
    return len(paths)


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
    """Time each candidate at `threads` and at one thread fewer, interleaved call by call (a
    load that comes and goes, as another process's, then slows every candidate alike)."""
    import torch
    variants = [(name, threads) for name in names] + [(name, threads - 1) for name in names if threads > 1]
    logs: dict[tuple[str, int], list[float]] = {v: [] for v in variants}
    previous = torch.get_num_threads()
    patient_until = time.perf_counter() + PATIENCE_S
    try:
        for n, k in shapes:
            weights = {name: _rotation(name, n, k) for name in names}
            for m in ROW_MIX:
                calls = {v: _call(v[0], weights[v[0]], m, n, k) for v in variants}
                rounds = 3 if time.perf_counter() < patient_until else 1
                for v, seconds in _interleaved_medians(calls, rounds).items():
                    logs[v].append(math.log(seconds * 1e6 / m))
    finally:
        torch.set_num_threads(previous)
    score = {v: math.exp(sum(values) / len(values)) for v, values in logs.items()}
    chosen = min(variants[:len(names)], key=score.get)
    fewer = min(variants[len(names):], key=score.get, default=None)
    if fewer is not None and score[fewer] < score[chosen] * (1 - TIE):
        chosen = fewer
    scores = {_key(name, t, threads): round(value, 3) for (name, t), value in score.items()}
    return KernelPlan(chosen[0], chosen[1], scores, shapes, time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))


def _key(name: str, threads: int, budget: int) -> str:
    """A candidate's name in `scores_us`: the name at the full thread budget, else name@Nthreads."""
    return name if threads == budget else f"{name}@{threads}threads"


def _rotation(name: str, n: int, k: int) -> list[tuple]:
    """Copies of one random int4 [n, k] weight in `name`'s layout that together exceed the
    caches, as a model's layers do: in cache, a kernel that does more arithmetic per weight
    looks better than it is."""
    import torch

    from cpu_kernels import packing
    from cpu_kernels.quant_format import quantize
    weight = quantize(torch.randn(n, k, generator=torch.Generator().manual_seed(n * k)) * 0.05, "int4")
    base = (weight.qweight, weight.scales, weight.zeros) if name == "float32" else (packing.pack(weight).data,)
    nbytes = sum(t.numel() * t.element_size() for t in base)
    return [tuple(t.clone() for t in base) for _ in range(min(256, max(2, ROTATE_BYTES // nbytes)))]


def _call(name: str, copies: list[tuple], m: int, n: int, k: int):
    """One call of `name`'s kernel on m rows, the next weight copy each time."""
    import torch

    from cpu_kernels import ops
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    turn = iter(range(1 << 62))
    if name == "float32":
        def call():
            qweight, scales, zeros = copies[next(turn) % len(copies)]
            ops.int4_linear(x, qweight, scales, zeros)
        return call
    xb, amx = x.bfloat16(), name == "amx"

    def call_bf16():
        ops.bf16_quant_linear(xb, "int4", copies[next(turn) % len(copies)][0], n, amx)
    return call_bf16


def _interleaved_medians(calls: dict, rounds: int = 3, budget_s: float = 0.02, most: int = 50) -> dict:
    """Median seconds of each (name, threads) -> call, the calls taken in turn: at least
    `rounds` rounds, more while the budget lasts."""
    import torch
    times: dict = {v: [] for v in calls}
    for (_, threads), call in calls.items():  # warm: first-touch of buffers, thread pool start
        torch.set_num_threads(threads)
        call()
    deadline = time.perf_counter() + budget_s * len(calls)
    while min(map(len, times.values())) < rounds or (time.perf_counter() < deadline
                                                     and len(times[next(iter(times))]) < most):
        for v, call in calls.items():
            torch.set_num_threads(v[1])
            start = time.perf_counter()
            call()
            times[v].append(time.perf_counter() - start)
    return {v: sorted(t)[len(t) // 2] for v, t in times.items()}


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
