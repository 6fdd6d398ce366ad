"""The closing table of `bash bench/gpu_session.sh throughput`: each step's outcome, then the
numbers of the offline, serve and gpu-busy JSONs it wrote, side by side.

    python -m bench.throughput_report JSON_DIR STEPS_FILE
    python -m bench.throughput_report --plot DIR PNG [JSON...]   # one chart of a session's output tok/s

The plot is drawn afterwards, from the JSONs (a device call returns few files).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from bench.reporting import print_table


def print_steps(steps_file: Path) -> None:
    """STEPS_FILE lines: name|rc|seconds|last line of its log (written by gpu_session.sh's step)."""
    print(f"\n{'step':<18} {'rc':>7} {'s':>4}  last line")
    for line in steps_file.read_text().splitlines():
        name, rc, secs, last = line.split("|", 3)
        print(f"{name:<18} {rc:>7} {secs:>4}  {last}")


def offline_label(r: dict) -> str:
    """The engine run of an offline JSON: backend, async, and for a long-prompt (prefill) run
    its prompt length and prefill kernels (PAGEDSERVE_CUPY_PREFILL)."""
    label = r["engine_config"]["attention_backend"]
    if r["engine_config"].get("async_scheduling"):
        label += ", async"
    if r["workload"]["output_len"] == 1:
        prefill = r["machine"].get("pagedserve_env", {}).get("PAGEDSERVE_CUPY_PREFILL", "")
        label += f", {r['workload']['input_len']} in{', ' + prefill if prefill else ''}"
    return label


def offline_rows(out: Path) -> list[list[object]]:
    """One row per measured run of each offline JSON: engine by backend, then HF."""
    rows = []
    for path in sorted(out.glob("offline-*.json")):
        r = json.loads(path.read_text())
        single = r["results"]["engine_single"]
        rows.append([f"engine {offline_label(r)}", r["results"]["engine_batch"]["output_tok_s"],
                     r["results"]["engine_batch"].get("prompt_tok_s", ""),
                     single["decode_tok_s"], single["ttft_s"] * 1000, path.name])
        rows += [[name.replace("_", " "), res["output_tok_s"], "", "", "", path.name]
                 for name, res in r["results"].items() if name.startswith("hf_")]
    return rows


def serve_rows(out: Path) -> list[list[object]]:
    rows = []
    for path in sorted(out.glob("serve-*.json")):
        r = json.loads(path.read_text())
        s = r["results"][r["api"]]
        rows.append([r["label"], r["max_concurrency"], s["output_tok_s"], s["median_ttft_ms"],
                     s["median_tpot_ms"], f"{s['completed']} / {s['failed']}", path.name])
    return rows


def gpu_busy_rows(out: Path) -> list[list[object]]:
    rows = []
    for path in sorted(out.glob("gpu-busy-*.json")):
        r = json.loads(path.read_text())
        res = r["results"]
        busy = res.get("gpu_busy")
        mode = "async" if r["workload"].get("async_scheduling") else "sync"
        if r["workload"].get("layer_kernels") is False:
            mode += ", eager layers"
        if r.get("machine", {}).get("pagedserve_env", {}).get("PAGEDSERVE_CUPY_DECODE") == "mma":
            mode += ", mma decode"
        rows.append([f"{r['workload']['model']}, {r['workload']['num_seqs']} seqs, {mode}", f"{res['timed']['step_ms']:.2f}", f"{res['bound_ms']:.2f}",
                     f"{res['step_ms_over_bound']:.2f}", "" if busy is None else f"{100 * busy:.1f}%",
                     path.name])
    return rows


# The targets of issue 28 (H100, random qwen2.5-0.5b, 256 streams), output tok/s.
TARGETS = {"offline": 40_000, "gRPC": 40_000, "HTTP": 30_000}


def plot(paths: list[Path], png: Path) -> Path:
    """Horizontal bars of output tok/s: the engine offline (each backend), HF, and serving."""
    from bench.plots import save_figure
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = []  # (label, tok/s, target or None)
    gpu = "GPU"
    for path in paths:
        r = json.loads(path.read_text())
        gpu = r.get("machine", {}).get("gpu") or gpu
        if (r.get("benchmark") == "offline" or path.name.startswith("offline-")) and r["workload"]["output_len"] == 1:
            continue  # a prefill run: its output tok/s is no decode throughput
        if r.get("benchmark") == "offline" or path.name.startswith("offline-"):
            backend = r["engine_config"]["attention_backend"]
            mode = ", async" if r["engine_config"].get("async_scheduling") else ""
            rows.append((f"offline, {backend} attention{mode}", r["results"]["engine_batch"]["output_tok_s"],
                         TARGETS["offline"] if backend == "cupy" else None))
            rows += [(f"HF generate, {name[3:].replace('_', ' ')}", res["output_tok_s"], None)
                     for name, res in r["results"].items() if name.startswith("hf_") and "batch" in name]
        elif path.name.startswith("serve-"):
            api = "gRPC" if r["api"] == "grpc" else "HTTP"
            variant = r["label"].split("-", 1)[1] if "-" in r["label"] else ""  # e.g. grpc-admit0
            rows.append((f"serve, {api}, concurrency {r['max_concurrency']}{', ' + variant if variant else ''}",
                         r["results"][r["api"]]["output_tok_s"], TARGETS[api]))
    rows.sort(key=lambda row: row[1])
    fig, ax = plt.subplots(figsize=(8, 0.55 * len(rows) + 1.4))
    bars = ax.barh([row[0] for row in rows], [row[1] for row in rows],
                   color=["tab:gray" if row[0].startswith("HF") else "tab:blue" for row in rows])
    ax.bar_label(bars, fmt="%.0f", padding=3)
    for i, (_, _, target) in enumerate(rows):
        if target:
            ax.plot([target, target], [i - 0.4, i + 0.4], color="tab:red", lw=2)
    ax.set_xlabel("output tokens / s (red: the issue's target)")
    ax.set_title(f"{gpu}\nrandom-weight qwen2.5-0.5b bf16, 128 in / 128 out, 256 streams", fontsize=9)
    ax.margins(x=0.12)
    return save_figure(fig, png)


def main(argv: list[str]) -> int:
    if argv and argv[0] == "--plot":
        print(plot([Path(p) for p in argv[2:]], Path(argv[1])))
        return 0
    out, steps = Path(argv[0]), Path(argv[1])
    print_steps(steps)
    offline, serve = offline_rows(out), serve_rows(out)
    if offline:
        print()
        print_table(["offline", "output tok/s", "prompt tok/s", "1-stream tok/s", "1-stream TTFT ms", "file"],
                    offline)
    if serve:
        print()
        print_table(["serve", "concurrency", "output tok/s", "TTFT p50 ms", "TPOT p50 ms", "done / failed",
                     "file"], serve)
    busy = gpu_busy_rows(out)
    if busy:
        print()
        print_table(["gpu-busy: decode", "step ms", "bound ms", "step / bound", "GPU busy", "file"], busy)
    if not offline and not serve:
        print("\nno offline or serve JSON: see throughput-logs.txt")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
