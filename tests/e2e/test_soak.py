"""`pagedserve bench soak` in CI: 3 minutes of mixed load with cancels and short deadlines
(30 with --long), then no KV block, request or memory may have leaked."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import LONG

pytestmark = pytest.mark.heavy(195)  # seconds on the 2-core CI machine: scheduled first

ROOT = Path(__file__).resolve().parents[2]
MINUTES = 30 if LONG else 3
MAX_RSS_GROWTH = 0.05 if LONG else 0.10


def test_soak_leaks_nothing(tmp_path):
    cmd = [sys.executable, "-m", "pagedserve", "bench", "soak", "--minutes", str(MINUTES), "--sample-s", "2",
           "--concurrency", "16", "--max-rss-growth", str(MAX_RSS_GROWTH), "--output-dir", str(tmp_path),
           "--dtype", "float32", "--num-kv-blocks", "256", "--max-model-len", "512", "--num-threads", "1"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=MINUTES * 60 + 300)
    output = done.stdout[-4000:] + done.stderr[-4000:]
    [path] = tmp_path.glob("soak-*.json")
    report = json.loads(path.read_text())
    assert done.returncode == 0, output
    assert report["passed"] and all(report["checks"].values()), report["checks"]
    assert report["idle"]["kv_blocks_free"] == report["idle"]["kv_blocks_total"] == 256
    assert report["outcomes"]["ok"] > 100 and report["outcomes"]["cancelled"] > 10, report["outcomes"]
    assert report["outcomes"].get("unexpected", 0) == 0, report["unexpected"]
    assert all(g < MAX_RSS_GROWTH for g in report["rss_growth"].values()), report["rss_growth"]
    assert len(report["samples"]) >= MINUTES * 60 / 2 - 5
    assert path.with_suffix(".png").stat().st_size > 10_000
