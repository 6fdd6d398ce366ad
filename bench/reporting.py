"""What every benchmark shares: the machine it ran on, result files, tables."""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RESULTS_DIR = Path(__file__).resolve().parent / "results"
# The /proc/cpuinfo flags that decide which SIMD paths oneDNN and llama.cpp's ggml take.
SIMD_FLAGS = ("sse4_2", "avx", "avx2", "fma", "f16c", "avx_vnni", "avx512f", "avx512bw", "avx512vl", "avx512_vnni",
              "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8")


def machine_info(device: str = "cpu") -> dict:
    import torch

    from engine.config import cpu_has_bf16
    info = {
        "hostname": platform.node(), "platform": platform.platform(), "python": platform.python_version(),
        "torch": torch.__version__, "cpu": _cpu_model(), "num_cpus": os.cpu_count(),
        "memory_gb": _memory_gb(), "device": device,
        # What CPU matmuls run on: bf16 is ~5x slower than float32 without bf16 instructions.
        "cpu_capability": torch.backends.cpu.get_cpu_capability(), "cpu_bf16": cpu_has_bf16(),
        "cpu_flags": _cpu_flags(),
        # Switches such as PAGEDSERVE_CUPY_PREFILL (an A/B of the prefill kernels) change what ran.
        "pagedserve_env": {k: v for k, v in os.environ.items() if k.startswith("PAGEDSERVE_")},
    }
    if device == "cpu":  # which quantized-linear kernel ran (cpu_kernels/dispatch.py), and why
        from cpu_kernels.dispatch import machine_plan
        plan = machine_plan(unchecked=True)  # what the servers read, not a new timing under their load
        info["cpu_kernel_plan"] = plan.reason() if plan else None
    if device.startswith("cuda") and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(torch.device(device))
    return info


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _cpu_flags() -> list[str]:
    """The SIMD_FLAGS this CPU has, in SIMD_FLAGS order."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                have = set(line.split(":", 1)[1].split())
                return [f for f in SIMD_FLAGS if f in have]
    except OSError:
        pass
    return []


def _memory_gb() -> float | None:
    try:
        kb = int(Path("/proc/meminfo").read_text().split()[1])
        return round(kb / 2**20, 1)
    except (OSError, ValueError, IndexError):
        return None


class Worktree:
    """Git commit `ref` of this checkout in a temporary worktree (a benchmark's --baseline):
    `sha`, `tree`; `close()` removes it."""

    def __init__(self, ref: str) -> None:
        self.root = Path(__file__).resolve().parent.parent
        self.sha = subprocess.check_output(["git", "-C", str(self.root), "rev-parse", ref], text=True).strip()
        self._tmp = tempfile.TemporaryDirectory(prefix="pagedserve-baseline-")
        self.tree = Path(self._tmp.name) / "tree"
        subprocess.run(["git", "-C", str(self.root), "worktree", "add", "--detach", str(self.tree), self.sha],
                       check=True, capture_output=True)

    def close(self) -> None:
        subprocess.run(["git", "-C", str(self.root), "worktree", "remove", "--force", str(self.tree)], check=False)
        self._tmp.cleanup()


class OtherLoad:
    """The CPU that processes other than this one and its children used from now on, in cores
    on average: what a shared machine took from a run (/proc/stat's busy time less ours)."""

    def __init__(self) -> None:
        self.start = (time.perf_counter(), _machine_busy_s(), _own_cpu_s())

    def cores(self) -> float | None:
        busy, own = _machine_busy_s(), _own_cpu_s()
        if None in (busy, own, self.start[1], self.start[2]):
            return None
        return max(0.0, (busy - self.start[1] - own + self.start[2]) / (time.perf_counter() - self.start[0]))


def _machine_busy_s() -> float | None:
    try:
        with open("/proc/stat") as f:
            ticks = [int(v) for v in f.readline().split()[1:8]]  # user nice system idle iowait irq softirq
    except (OSError, ValueError):
        return None
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")


def _own_cpu_s() -> float | None:
    """This process's CPU seconds and its children's: those alive, and those it has waited for."""
    import resource

    import psutil
    try:
        me = psutil.Process()
        alive = sum(sum(p.cpu_times()[:2]) for p in (me, *me.children(recursive=True)))
    except psutil.Error:
        return None
    waited = resource.getrusage(resource.RUSAGE_CHILDREN)
    return alive + waited.ru_utime + waited.ru_stime


def name_plot(path: Path, chart: Path) -> Path:
    """Record the chart written beside the result file `path` in it, as "plot"; returns the chart."""
    path.write_text(json.dumps({**json.loads(path.read_text()), "plot": chart.name}, indent=2) + "\n")
    return chart


def write_result(name: str, payload: dict, out_dir: Path | None = None, suffix: str = "") -> Path:
    """`<name>-<UTC stamp><suffix>.json`; never overwrites (runs in the same second share a stamp)."""
    out_dir = Path(out_dir or RESULTS_DIR)
    out_dir.mkdir(parents=True, exist_ok=True)
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    payload = {"benchmark": name, "created_utc": stamp, **payload}
    path = out_dir / f"{name}-{stamp}{suffix}.json"
    for n in range(2, 1000):
        if not path.exists():
            break
        path = out_dir / f"{name}-{stamp}{suffix}-{n}.json"
    path.write_text(json.dumps(payload, indent=2) + "\n")
    return path


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def print_table(headers: list[str], rows: list[list[object]]) -> None:
    cells = [[_fmt(c) for c in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]
    line = "  ".join(h.ljust(w) for h, w in zip(headers, widths))
    print(line)
    print("-" * len(line))
    for r in cells:
        print("  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))))


def _fmt(value: object) -> str:
    if isinstance(value, float):
        return f"{value:,.1f}" if abs(value) >= 10 else f"{value:.2f}"
    return str(value)


def load_rss(model: str, llm_kwargs: dict, prelude: str = "") -> int:
    """Bytes a fresh process's RSS grows by while `LLM(model, **llm_kwargs)` loads, with a KV
    cache of 16 blocks and the tokenizer's imports done first (its object is counted): in a
    process of its own, so that memory an earlier measurement freed cannot hide the growth.
    `prelude`: Python run before (e.g. a patch choosing a loading path)."""
    script = f"""
import json, psutil
from pathlib import Path
from engine.models.loader import load_tokenizer
from pagedserve import LLM
{prelude}
load_tokenizer(Path({model!r}))
before = psutil.Process().memory_info().rss
llm = LLM({model!r}, enable_prefix_caching=False, num_kv_blocks=16, max_model_len=256, **{llm_kwargs!r})
print(json.dumps(psutil.Process().memory_info().rss - before))
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    return int(done.stdout.strip().splitlines()[-1])


def model_bytes(model: Path) -> int:
    """A model's size on disk: a GGUF file's, or a folder's weights (its safetensors)."""
    return model.stat().st_size if model.is_file() else sum(f.stat().st_size for f in model.glob("*.safetensors"))
