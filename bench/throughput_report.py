"""The closing table of `bash bench/gpu_session.sh throughput`: each step's outcome, then the
numbers of the offline and serve JSONs it left in OUT, side by side.

    python -m bench.throughput_report OUT STEPS_FILE
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from bench.common import print_table


def print_steps(steps_file: Path) -> None:
    """STEPS_FILE lines: name|rc|seconds|last line of its log (written by gpu_session.sh's step)."""
    print(f"\n{'step':<14} {'rc':>7} {'s':>4}  last line")
    for line in steps_file.read_text().splitlines():
        name, rc, secs, last = line.split("|", 3)
        print(f"{name:<14} {rc:>7} {secs:>4}  {last}")


def offline_rows(out: Path) -> list[list[object]]:
    """One row per measured run of each offline JSON: engine by backend, then HF."""
    rows = []
    for path in sorted(out.glob("offline-*.json")):
        r = json.loads(path.read_text())
        backend = r["engine_config"]["attention_backend"]
        single = r["results"]["engine_single"]
        rows.append([f"engine {backend}", r["results"]["engine_batch"]["output_tok_s"],
                     single["decode_tok_s"], single["ttft_s"] * 1000, path.name])
        rows += [[name.replace("_", " "), res["output_tok_s"], "", "", path.name]
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


def main(argv: list[str]) -> int:
    out, steps = Path(argv[0]), Path(argv[1])
    print_steps(steps)
    offline, serve = offline_rows(out), serve_rows(out)
    if offline:
        print()
        print_table(["offline", "output tok/s", "1-stream tok/s", "1-stream TTFT ms", "file"], offline)
    if serve:
        print()
        print_table(["serve", "concurrency", "output tok/s", "TTFT p50 ms", "TPOT p50 ms", "done / failed",
                     "file"], serve)
    if not offline and not serve:
        print("\nno offline or serve JSON: see throughput-logs.txt")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
