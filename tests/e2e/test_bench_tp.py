"""`pagedserve bench tp` end to end on a tiny model: sizes 1 and 2, shared memory and gloo
alone, in float32, where every reply must equal size 1's."""

from __future__ import annotations

import json
import subprocess
import sys

from helpers import build_tiny_model


def test_bench_tp_writes_results(tmp_path, bundled_tokenizer):
    model = build_tiny_model("llama", tmp_path / "model", bundled_tokenizer)
    cmd = [sys.executable, "-m", "pagedserve", "bench", "tp", "--model", str(model), "--dtype", "float32",
           "--sizes", "1,2", "--num-prompts", "3", "--input-len", "20", "--output-len", "8", "--num-threads", "2",
           "--output-dir", str(tmp_path)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (result,) = tmp_path.glob("tp-*.json")
    payload = json.loads(result.read_text())
    assert payload["machine"]["cpu_flags"] is not None
    runs = [(r["size"], r["collectives"]) for r in payload["runs"]]
    assert runs == [(1, "-"), (2, "shm"), (2, "gloo")]
    for r in payload["runs"]:
        assert r["same_as_first"] == 3  # float32: sharding changes no token
        assert len(r["token_ids"]) == 3 and all(len(t) == 8 for t in r["token_ids"])
        assert r["out_tok_s"] > 0
