"""`pagedserve bench scaling` end to end: one engine, then two behind one frontend."""

from __future__ import annotations

import json
import subprocess
import sys


def test_bench_scaling_writes_results(tmp_path):
    cmd = [sys.executable, "-m", "pagedserve", "bench", "scaling", "--engines", "1,2", "--prompts-per-engine", "3",
           "--concurrency-per-engine", "2", "--input-len", "16", "--output-len", "4", "--num-kv-blocks", "64",
           "--output-dir", str(tmp_path)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "efficiency" in done.stdout
    (result,) = tmp_path.glob("scaling-*.json")
    assert result.with_suffix(".png").exists()
    payload = json.loads(result.read_text())
    assert payload["machine"]["cpu_flags"] is not None
    one, two = payload["runs"]
    assert (one["engines"], two["engines"]) == (1, 2)
    for run in (one, two):
        assert run["summary"]["failed"] == 0
        assert run["summary"]["output_tokens"] == 4 * 3 * run["engines"]
        assert set(run["cpu_s"]) == {f"engine{i}" for i in range(run["engines"])} | {"frontend", "client"}
        # /proc counts CPU in 10 ms ticks: the frontend and the client may spend less than one
        # on 12 tokens; each engine runs the model.
        assert all(v >= 0 for v in run["cpu_s"].values())
        assert all(run["cpu_s"][f"engine{i}"] > 0 for i in range(run["engines"]))
    assert one["efficiency"] == 1.0
    assert 0 < two["efficiency"]
    # Both engines generated: the frontend split the traffic.
    assert len(two["engine_token_share"]) == 2 and min(two["engine_token_share"]) > 0
    assert sum(c["generation_tokens"] for c in two["engine_counters"]) == 24
