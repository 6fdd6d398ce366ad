"""What `bench serve` prints, and the summary JSON of a sweep."""

from __future__ import annotations

import argparse
import math

from bench.common import print_table
from bench.serve_metrics import LATENCIES, STATS, rate_label

# The per-run numbers a sweep summary keeps (each run's own JSON has everything).
KEY_METRICS = ("completed", "failed", "errors", "duration_s", "request_throughput", "output_tok_s", "total_tok_s",
               "cached_tokens", "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "median_tpot_ms",
               "p99_tpot_ms", "median_itl_ms", "p99_itl_ms", "median_e2e_ms", "p99_e2e_ms", "goodput_req_s")


def print_run(label: str, summary: dict, offline: dict | None, ratios: dict) -> None:
    rows = [["completed / failed", f"{summary['completed']} / {summary['failed']}"],
            ["duration (s)", summary["duration_s"]],
            ["request throughput (req/s)", summary["request_throughput"]],
            ["output throughput (tok/s)", summary["output_tok_s"]],
            ["total throughput (tok/s)", summary["total_tok_s"]]]
    if "goodput_req_s" in summary:
        slos = " ".join(f"{k}:{v:g}" for k, v in summary["goodput_slos_ms"].items())
        rows.append([f"goodput (req/s, {slos} ms)", summary["goodput_req_s"]])
    if summary["cached_tokens"]:
        rows.append(["prompt tokens from prefix cache", f"{summary['cached_tokens']} / {summary['prompt_tokens']}"])
    if offline:
        rows.append([f"offline, {offline['max_num_seqs']} seqs at most (tok/s)", offline["output_tok_s"]])
        rows.append(["offline, all prompts at once (tok/s)", offline["all_at_once"]["output_tok_s"]])
    print(f"\n{label}")
    print_table(["metric", "value"], rows)
    print()
    latency_rows = [[name.replace("_ms", "").upper() + " (ms)",
                     *(_cell(summary[f"{stat}_{name}"]) for stat in STATS)] for name in LATENCIES]
    print_table(["latency", *STATS], latency_rows)
    if summary["errors"]:
        print(f"\nfailed requests by code: {summary['errors']}")
    if ratios:
        print(f"\ngrpc / offline output throughput = {ratios['grpc_vs_offline_output_tok_s'] * 100:.1f}% "
              f"(same concurrency); {ratios['grpc_vs_offline_all_at_once_output_tok_s'] * 100:.1f}% "
              f"of offline with all prompts at once")


def print_runs(runs: list[dict]) -> None:
    """One row per run: the numbers a sweep is about."""
    rows = [[r["backend"], r["request_rate"], f"{r['completed']} / {r['failed']}", r["request_throughput"],
             r["output_tok_s"], _cell(r["median_ttft_ms"]), _cell(r["p99_ttft_ms"]), _cell(r["median_tpot_ms"]),
             _cell(r["p99_tpot_ms"]), _cell(r.get("goodput_req_s"))] for r in runs]
    print()
    print_table(["backend", "rate (req/s)", "ok / failed", "req/s", "out tok/s", "TTFT p50", "TTFT p99",
                 "TPOT p50", "TPOT p99", "goodput"], rows)
    print("(latencies in ms; goodput in req/s, n/a without --goodput)")


def sweep_payload(runs: list[dict], machine: dict, model: dict, dataset: dict, plan,
                  args: argparse.Namespace) -> dict:
    return {
        "machine": machine, "model": model, "dataset": dataset, "num_prompts": args.num_prompts,
        "backends": plan.backends, "request_rates": [rate_label(r) for r in plan.rates],
        "burstiness": args.burstiness, "max_concurrency": args.max_concurrency, "target": args.target,
        "goodput_slos_ms": plan.slos, "seed": args.seed,
        "runs": [{"backend": r["backend"], "request_rate": r["request_rate"], "file": r["file"],
                  **{k: r[k] for k in KEY_METRICS if k in r}} for r in runs],
    }


def _cell(value: float | None) -> object:
    return "n/a" if value is None or (isinstance(value, float) and math.isnan(value)) else value
