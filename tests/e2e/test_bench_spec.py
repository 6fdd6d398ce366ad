"""`pagedserve bench spec` end to end: a server per config, real gRPC, the engine's /metrics,
JSON and PNG on disk. Tiny: two prompts of at most eight tokens per run, one torch thread."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FLAGS = ["--configs", "--draft-model", "--workloads", "--concurrency", "--num-prompts", "--edit-output-ratio",
         "--random-input-len", "--random-output-len", "--max-output-len", "--seed", "--output-dir",
         "--num-speculative-tokens", "--prompt-lookup-min", "--prompt-lookup-max", "--model", "--num-threads"]


def bench_spec(*args: str, timeout_s: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pagedserve", "bench", "spec", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout_s)


def test_help_lists_every_flag():
    result = bench_spec("--help", timeout_s=60)
    assert result.returncode == 0, result.stderr
    missing = [f for f in FLAGS if f not in result.stdout]
    assert not missing, f"--help lacks {missing}:\n{result.stdout}"


def test_off_and_ngram_on_both_workloads(tmp_path):
    result = bench_spec("--configs", "off,ngram", "--concurrency", "1", "--num-prompts", "2", "--max-output-len", "8",
                        "--random-input-len", "16", "--dtype", "float32", "--num-threads", "1",
                        "--num-kv-blocks", "64", "--num-speculative-tokens", "3", "--output-dir", str(tmp_path))
    assert result.returncode == 0, result.stdout + result.stderr
    [path] = tmp_path.glob("spec-decode-*.json")
    payload = json.loads(path.read_text())
    assert (tmp_path / payload["plot"]).stat().st_size > 10_000
    assert payload["machine"]["cpu_flags"] is not None and payload["configs"] == ["off", "ngram"]
    assert "--speculative-method" not in payload["server_commands"]["off"]
    ngram = payload["server_commands"]["ngram"]
    assert ngram[ngram.index("--speculative-method") + 1] == "ngram"
    assert [(r["workload"], r["concurrency"], r["config"]) for r in payload["runs"]] == [
        ("edit", 1, "off"), ("edit", 1, "ngram"), ("random", 1, "off"), ("random", 1, "ngram")]
    for run in payload["runs"]:
        assert (run["completed"], run["failed"]) == (2, 0), run["errors"]
        assert 0 < run["output_tokens"] <= 16 and run["median_tpot_ms"] > 0 and run["median_ttft_ms"] > 0
        assert run["output_tok_s"] > 0 and run["tpot_speedup"] > 0
        if run["workload"] == "random":  # eos ignored: exactly the planned length
            assert run["output_tokens"] == 16 and run["finish_reasons"] == {"FINISH_REASON_LENGTH": 2}
        if run["config"] == "ngram":  # greedy verification is lossless
            assert run["same_as_off"] == 2
        else:
            assert run["tpot_speedup"] == 1.0 and run["same_as_off"] is None
        _check_acceptance(run["acceptance"], run["config"], k=3)
        assert all(r["ok"] and r["num_output_tokens"] > 0 and r["text"] for r in run["requests"])
    assert payload["workloads"]["edit"]["distinct_tasks"] == 2 and payload["workloads"]["random"]["eos"] == "ignored"
    assert "TPOT speed-up" in result.stdout and f"wrote {path}" in result.stdout


def _check_acceptance(figures: dict | None, config: str, k: int) -> None:
    """None until the engine exports its counters; then consistent with each other."""
    if figures is None:
        return
    if config == "off":
        assert figures["num_drafts"] == 0
        return
    assert 0 <= figures["num_accepted_tokens"] <= figures["num_draft_tokens"] <= k * figures["num_drafts"]
    assert sum(figures["num_accepted_tokens_per_pos"]) == figures["num_accepted_tokens"]
    assert len(figures["num_accepted_tokens_per_pos"]) <= k
    if figures["num_drafts"]:
        assert 0 <= figures["acceptance_rate"] <= 1 and 1 <= figures["mean_acceptance_length"] <= k + 1
