"""Which quantized-linear kernel, dtype and thread count this machine runs, by measurement.

Our VMs (and users' machines) differ: AMD Zen 4 with AVX512-BF16, Intel with AMX, AVX2
only. A rule written on one of them ("bf16 wherever AVX512-BF16 is") was wrong on another,
so the choice is timed: the first time an engine loads a model of given layer shapes on a
machine (or `make setup`'s warm step, for the bundled model), each candidate runs the
model's linear shapes at a mix of row counts, and the fastest wins. The result is cached
next to the compiled kernels, keyed by the CPU's flags, torch, the kernels' sources, the
shapes and the thread budget, so a later start reads it (and checks it: below).

Candidates (those this CPU and build run):
  amx          bf16 activations, AMX tiles from 2 rows on over bf16-dequantized weights, the
               same arithmetic at one row (csrc/quant_linear_bf16.cpp)
  avx512_bf16  bf16 activations, VDPBF16PS throughout
  float32      float32 activations (csrc/quant_linear.cpp)
  int8         8-bit activations in integer dot products (csrc/int_dot.cpp): measured and
               recorded beside the others, chosen only by `--cpu-arithmetic int8`. It changes
               the numbers (activations rounded to 8 bits), and issue 49's rule lets a plan
               take it by default only where its perplexity is within 0.5% of float32's and its
               greedy agreement at least bf16's (bench/cpu_arithmetic.py measures both):
               INT8_BY_DEFAULT records that verdict.
The score is the geometric mean, over the model's shapes and the row counts (1, 8, 64,
512), of the time per row: one decoding stream, a small batch, a big batch's decode step and
a prefill chunk each weigh the same in relative terms (a sum would let the one-row times,
the largest per row, decide alone). The thread counts tried are the budget
and one fewer (the frontend and the tokenizer share the cores); ties (within 3%) go to more
threads. All candidates are timed call by call in turn, so that a load that comes and goes
(another process; the test suite's parallel workers) slows them alike. Each kernel is batch invariant under its own arithmetic, and the choice never
depends on the batch: it is made once per process.

A plan measured while the machine was busy can name the wrong winner (with another process on
the second core, one thread wins). So a cached plan is checked when a process first reads it
(`quick_check`, about 0.1 s): the candidates are timed again on the plan's cheapest cases (its
smallest layer at the row counts up to CHECK_MACS of work), and if the runner-up now beats the
winner there by more than CHECK_MARGIN, the plan is measured again. `python -m cpu_kernels.warm --remeasure` forgets every cached plan.

`PAGEDSERVE_CPU_ARITHMETIC=amx|avx512_bf16|float32` skips the measurement and takes that
kernel (where this CPU runs it): to compare them, or to pin one across a fleet. (int8 is an
engine flag, `--cpu-arithmetic int8`, since it is a choice of numbers, not of speed alone.)
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import itertools
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
# The quick check of a cached plan: cases of at most this much work (rows x N x K; a few ms a
# call), and how much more time per row than the runner-up its winner may now take beyond
# what the plan recorded (noise under a passing load stays below it; a wrong winner is 2x).
CHECK_MACS = 1 << 28
CHECK_MARGIN = 0.15
EXACT = ("amx", "avx512_bf16", "float32")  # every product exact: the plan may pick any of them
# Whether the plan may choose int8 by default: bench/cpu_arithmetic.py's verdict on the
# bundled model (docs/cpu.md, "Which arithmetic by default").
INT8_BY_DEFAULT = False
log = logging.getLogger("pagedserve.cpu_kernels")


@dataclasses.dataclass(frozen=True)
class KernelPlan:
    arithmetic: str  # "amx" | "avx512_bf16" | "float32" (| "int8" only if INT8_BY_DEFAULT)
    threads: int
    scores_us: dict[str, float]  # candidate -> geometric mean of microseconds per row (ROW_MIX x shapes)
    shapes: list[tuple[int, int]]
    measured_at: str
    # candidate -> microseconds per row of each case (shapes x ROW_MIX, in that order): what
    # the quick check compares its own timing with
    cases_us: dict[str, list[float]] = dataclasses.field(default_factory=dict)

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
        others = ", ".join(f"{name}{'' if _eligible(name) else ' (opt-in)'} {score / best:.2f}x"
                           for name, score in ranked)
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


def machine_plan(unchecked: bool = False) -> KernelPlan | None:
    """The plan for the bundled model's shapes with this process's thread budget: what
    `--dtype auto` means on this machine (engine/config.resolve_dtype). `unchecked`: see `plan`."""
    from common.process_args import default_num_threads
    return plan(DEFAULT_SHAPES, default_num_threads(), unchecked)


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
    if ops.int_dot_supported():
        out.append("int8")
    return out


def _eligible(key: str) -> bool:
    """Whether the plan may choose this candidate (a `scores_us` key) by itself."""
    return key.partition("@")[0] in EXACT or INT8_BY_DEFAULT


def plan(shapes: list[tuple[int, int]], threads: int, unchecked: bool = False) -> KernelPlan | None:
    """The measured plan for linear layers of `shapes` ([(N, K)], K a multiple of 32) with
    at most `threads` threads; None where no quantized kernel runs here. Cached on disk; the
    first call per machine and shapes measures (about a second), under a file lock so that
    processes starting together measure once. `unchecked`: a cached plan as it is, without the
    quick check (a benchmark's report of what its servers read: timed while a peer server
    loads the machine, the check would measure that load and rewrite the plan they share)."""
    names = candidates()
    if not names:
        return None
    shapes = sorted({(int(n), int(k)) for n, k in shapes if k % 32 == 0})
    if not shapes:
        return None
    forced = os.environ.get(ENV)
    if forced:
        if forced == "int8":
            raise ValueError(f"{ENV}=int8: the integer arithmetic is an engine flag, --cpu-arithmetic int8")
        if forced not in names:
            raise ValueError(f"{ENV}={forced!r}: this CPU runs {', '.join(names)}")
        return KernelPlan(forced, threads, {}, shapes, f"set by {ENV}")
    path = _cache_path(shapes, threads, names)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(str(path) + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes (checks too: one at a time)
        cached = _read(path)
        if cached is not None and (unchecked or _still_holds(cached, threads)):
            return cached
        result = measure(shapes, threads, names)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(dataclasses.asdict(result), indent=1))
        tmp.replace(path)
    _HOLDING.add(_text(result))  # just measured: nothing to check in this process
    log.info("CPU kernel plan: %s", result.reason())
    return result


def measure(shapes: list[tuple[int, int]], threads: int, names: list[str]) -> KernelPlan:
    """Time each candidate at `threads` and at one thread fewer, interleaved call by call (a
    load that comes and goes, as another process's, then slows every candidate alike)."""
    variants = [(name, threads) for name in names] + [(name, threads - 1) for name in names if threads > 1]
    cases = _time_per_row(variants, [(n, k, m) for n, k in shapes for m in ROW_MIX], patience_s=PATIENCE_S)
    score = {v: _geomean(values) for v, values in cases.items()}
    eligible = [v for v in variants if _eligible(v[0])]
    chosen = min((v for v in eligible if v[1] == threads), key=score.get)
    fewer = min((v for v in eligible if v[1] < threads), key=score.get, default=None)
    if fewer is not None and score[fewer] < score[chosen] * (1 - TIE):
        chosen = fewer
    scores = {_key(name, t, threads): round(value, 3) for (name, t), value in score.items()}
    return KernelPlan(chosen[0], chosen[1], scores, shapes, time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                      {_key(name, t, threads): [round(us, 3) for us in values] for (name, t), values in cases.items()})


def quick_check(plan: KernelPlan, budget: int) -> str | None:
    """Why a cached plan no longer holds on this machine now, or None if it does. Its
    candidates are timed again as `measure` timed them (all of them, interleaved: a one-thread
    call right after a two-thread one is not the same as after another one-thread call), on
    its smallest layer at the row counts of ROW_MIX up to CHECK_MACS of work; the plan fails
    if its winner now takes more than (1 + CHECK_MARGIN) times the runner-up's time per row
    there, times the ratio the plan recorded where that is above 1 (a winner may lose these
    cases and still win the mix). `budget`: the thread budget the plan was made for; the
    kernels are loaded (`candidates`)."""
    winner = _key(plan.arithmetic, plan.threads, budget)
    others = [key for key in plan.scores_us if key != winner and _eligible(key)]
    if not others or winner not in plan.cases_us:
        return None  # one candidate: nothing to compare with
    runner_up = min(others, key=plan.scores_us.get)
    n, k = min(plan.shapes, key=lambda shape: shape[0] * shape[1])
    first = plan.shapes.index((n, k)) * len(ROW_MIX)
    picked = [i for i, m in enumerate(ROW_MIX) if m * n * k <= CHECK_MACS] or [0]
    recorded = _geomean([plan.cases_us[winner][first + i] / plan.cases_us[runner_up][first + i] for i in picked])
    timed = [_variant(key, budget) for key in plan.scores_us if _eligible(key)]
    now = _time_per_row(timed, [(n, k, ROW_MIX[i]) for i in picked], budget_s=0.002)
    ratio = _geomean([a / b for a, b in zip(now[_variant(winner, budget)], now[_variant(runner_up, budget)])])
    if ratio <= max(1.0, recorded) * (1 + CHECK_MARGIN):
        return None
    rows = "/".join(str(ROW_MIX[i]) for i in picked)
    return (f"{winner} takes {ratio:.2f}x the time per row of {runner_up} on the {n}x{k} layer at rows {rows} "
            f"(measured {plan.measured_at}: {recorded:.2f}x)")


_HOLDING: set[str] = set()  # the plans (as _text) measured or checked in this process


def _still_holds(plan: KernelPlan, budget: int) -> bool:
    """quick_check, once per process and plan (the dtype and the model's layers may ask twice)."""
    text = _text(plan)
    if text in _HOLDING:
        return True
    start = time.perf_counter()
    reason = quick_check(plan, budget)
    log.debug("CPU kernel plan of %s checked in %.3f s", plan.measured_at, time.perf_counter() - start)
    if reason is not None:
        log.warning("the cached CPU kernel plan no longer holds: %s; measuring again", reason)
        return False
    _HOLDING.add(text)
    return True


def _text(plan: KernelPlan) -> str:
    return json.dumps(dataclasses.asdict(plan), sort_keys=True)


def _key(name: str, threads: int, budget: int) -> str:
    """A candidate's name in `scores_us`: the name at the full thread budget, else name@Nthreads."""
    return name if threads == budget else f"{name}@{threads}threads"


def _variant(key: str, budget: int) -> tuple[str, int]:
    """_key's inverse: (name, threads)."""
    name, _, fewer = key.partition("@")
    return name, int(fewer.removesuffix("threads")) if fewer else budget


def _geomean(values: list[float]) -> float:
    return math.exp(sum(map(math.log, values)) / len(values))


def _time_per_row(variants: list[tuple[str, int]], cases: list[tuple[int, int, int]], rounds: int = 3,
                  budget_s: float = 0.02, patience_s: float = math.inf) -> dict[tuple[str, int], list[float]]:
    """Microseconds per row of each (name, threads) variant on each (N, K, rows) case, the
    variants interleaved call by call; past `patience_s`, each remaining case is timed once."""
    import torch
    times: dict[tuple[str, int], list[float]] = {v: [] for v in variants}
    previous = torch.get_num_threads()
    patient_until = time.perf_counter() + patience_s
    try:
        for (n, k), same_shape in itertools.groupby(cases, key=lambda case: case[:2]):
            torch.set_num_threads(1)  # copies: a thread descheduled by a busy machine would stall each
            weights = {name: _rotation(name, n, k) for name in dict.fromkeys(v[0] for v in variants)}
            for _, _, m in same_shape:
                calls = {v: _call(v[0], weights[v[0]], m, n, k) for v in variants}
                turns = rounds if time.perf_counter() < patient_until else 1
                for v, seconds in _interleaved_medians(calls, turns, budget_s).items():
                    times[v].append(seconds * 1e6 / m)
    finally:
        torch.set_num_threads(previous)
    return times


def _rotation(name: str, n: int, k: int) -> list[tuple]:
    """Copies of one random int4 [n, k] weight in `name`'s layout that together exceed the
    caches, as a model's layers do: in cache, a kernel that does more arithmetic per weight
    looks better than it is."""
    base = _random_weight(name, n, k)
    copies = min(256, max(2, ROTATE_BYTES // sum(t.numel() * t.element_size() for t in base)))
    stacked = [t.unsqueeze(0).repeat(copies, *[1] * t.dim()) for t in base]  # one allocation each
    return [tuple(t[i] for t in stacked) for i in range(copies)]


def _random_weight(name: str, n: int, k: int) -> tuple:
    """A random int4 [n, k] weight in `name`'s layout, made for timing: the kernels' time does
    not depend on the values, so they are random nibbles, and the bf16 layout is one packed
    super-group of 128 rows repeated (each is independent of the others). Building it costs a
    copy, not a quantization and repack of the whole weight (1.3 s for 4096 x 4096 on 2 cores),
    which the quick check could not afford at every start."""
    import torch

    from cpu_kernels import packing
    from cpu_kernels.quant_format import BLOCK, QuantizedTensor

    def random(rows: int) -> QuantizedTensor:  # fp16-exact scales and zeros, as pack wants: values in +-0.06
        nibbles = torch.randint(0, 256, (rows, k // 2), dtype=torch.uint8, generator=torch.Generator().manual_seed(k))
        return QuantizedTensor("int4", nibbles, torch.full((rows, k // BLOCK), 2.0 ** -7),
                               torch.full((rows, k // BLOCK), -2.0 ** -4))

    if name == "float32":
        weight = random(n)
        return weight.qweight, weight.scales, weight.zeros
    if name == "int8":  # int_dot's layout: independent groups of 16 rows, one 128-row block repeated
        from cpu_kernels import int_dot_format
        pack, rows = (lambda w: int_dot_format.pack(w).data), 128
    else:
        pack, rows = (lambda w: packing.pack(w).data), packing.GROUP * packing.SUPER_GROUP
    whole, tail = divmod(n, rows)
    parts = [pack(random(rows)).repeat(whole)] if whole else []
    if tail:
        parts.append(pack(random(tail)))
    return (torch.cat(parts),)


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
    if name == "int8":
        from cpu_kernels.int_dot_format import PackedIntDot

        def call_int8():
            ops.int_dot_linear(xb, PackedIntDot(copies[next(turn) % len(copies)][0], "int4", n, k, "fp16"))
        return call_int8

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
    sources = b"".join((CSRC / f"{family}.cpp").read_bytes()
                       for family in ("quant_linear", "quant_linear_bf16", "int_dot", "int_dot_avx2"))
    key = hashlib.sha256(sources + Path(__file__).read_bytes() + torch.__version__.encode() + _cpu_flags().encode()
                         + json.dumps([shapes, threads, names]).encode()).hexdigest()[:16]
    return cache_dir() / "cpu_kernels" / f"plan-{key}.json"


def _read(path: Path) -> KernelPlan | None:
    with contextlib.suppress(OSError, ValueError, TypeError, KeyError):
        data = json.loads(path.read_text())
        data["shapes"] = [tuple(s) for s in data["shapes"]]
        return KernelPlan(**data)
    return None
