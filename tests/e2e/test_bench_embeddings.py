"""`pagedserve bench embeddings` end to end, tiny: sentence-transformers in process, pagedserve's
LLM.embed, then a real `pagedserve serve --model all-MiniLM-L6-v2` over HTTP; JSON and PNG on disk."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.heavy(30)  # seconds on the 2-core CI machine: scheduled first


def test_bench_embeddings_writes_results(tmp_path):
    cmd = [sys.executable, "-m", "pagedserve", "bench", "embeddings", "--num-texts", "24", "--max-len", "64",
           "--st-batch-sizes", "4,8", "--st-dtypes", "float32", "--texts-per-request", "8", "--clients", "2",
           "--latency-requests", "8", "--latency-clients", "4", "--dtype", "float32", "--num-threads", "1",
           "--output-dir", str(tmp_path)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (path,) = tmp_path.glob("embeddings-*.json")
    assert path.with_suffix(".png").stat().st_size > 10_000
    payload = json.loads(path.read_text())
    results = payload["results"]
    assert list(results) == ["st_float32_bs4", "st_float32_bs8", "offline", "server", "server_latency"]
    assert payload["baseline"] in ("st_float32_bs4", "st_float32_bs8")
    assert payload["workload"]["num_texts"] == 24 and 8 <= payload["workload"]["mean_len"] <= 64
    for name, r in results.items():
        assert r["texts_per_s"] > 0, name
    server, latency = results["server"], results["server_latency"]
    assert (server["dtype"], server["completed"], server["failed"], server["texts"]) == ("float32", 3, 0, 24)
    assert server["prompt_tokens"] == payload["workload"]["tokens"]  # the server counts as the sizing did
    assert (latency["completed"], latency["failed"], latency["texts"]) == (8, 0, 8)
    assert 0 < latency["median_e2e_ms"] <= latency["p99_e2e_ms"]
    # float32 throughout: every vector as sentence-transformers' own
    assert server["cosine"]["min"] >= 0.9999 and results["offline"]["cosine"]["min"] >= 0.9999
    assert payload["ratios"][f"server_vs_{payload['baseline']}"] > 0
    assert payload["machine"]["cpu_flags"] is not None and len(payload["loadavg_before"]) == 3
    assert "server_vs_" in done.stdout and "E2E p50" in done.stdout
