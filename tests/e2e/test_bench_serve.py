"""`pagedserve bench serve` end to end: it starts its own server, benchmarks it, writes JSON."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

FLAGS = ["--target", "--num-prompts", "--input-len", "--output-len", "--max-concurrency", "--seed",
         "--compare-offline", "--output-dir", "--dtype", "--model", "--num-kv-blocks"]


def bench_serve(*args: str, timeout_s: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pagedserve", "bench", "serve", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout_s)


def test_help_lists_every_flag():
    result = bench_serve("--help", timeout_s=60)
    assert result.returncode == 0, result.stderr
    missing = [f for f in FLAGS if f not in result.stdout]
    assert not missing, f"--help lacks {missing}:\n{result.stdout}"


def test_smoke_run_writes_json(tmp_path):
    result = bench_serve("--num-prompts", "4", "--input-len", "8", "--output-len", "4",
                         "--max-concurrency", "2", "--dtype", "float32", "--compare-offline",
                         "--output-dir", str(tmp_path))
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    [path] = tmp_path.glob("serve-*.json")
    payload = json.loads(path.read_text())
    grpc = payload["results"]["grpc"]
    assert (grpc["completed"], grpc["failed"]) == (4, 0), output
    assert grpc["output_tokens"] == 16
    assert grpc["mean_ttft_ms"] > 0
    assert all(r["num_output_tokens"] == 4 and r["ttft_s"] > 0 for r in payload["requests"])
    assert payload["ratios"]["grpc_vs_offline_output_tok_s"] > 0
    assert payload["results"]["offline"]["output_tokens"] == 16
    assert "grpc / offline output throughput = " in result.stdout
