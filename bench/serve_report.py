"""What `bench serve` prints, the summary JSON of a sweep, and the structured dataset's tables."""

from __future__ import annotations

import argparse
import math

from bench.reporting import print_table
from bench.serve_metrics import LATENCIES, STATS, rate_label
from bench.serve_structured import PHASES

# The per-run numbers a sweep summary keeps (each run's own JSON has everything).
KEY_METRICS = ("completed", "failed", "errors", "duration_s", "request_throughput", "output_tok_s", "total_tok_s",
               "cached_tokens", "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "median_tpot_ms",
               "p99_tpot_ms", "median_itl_ms", "p99_itl_ms", "median_e2e_ms", "p99_e2e_ms", "goodput_req_s")
# The structured dataset's table, one row per group.
GROUP_HEADER = ["group", "ok / failed", "JSON / valid", "mean out len", "out tok/s", "TPOT mean", "TPOT p50",
                "TPOT p99"]


def print_run(label: str, summary: dict, offline: dict | None, ratios: dict) -> None:
    rows = [["completed / failed", f"{summary['completed']} / {summary['failed']}"],
            ["duration (s)", summary["duration_s"]],
            ["request throughput (req/s)", summary["request_throughput"]]]
    if "texts_per_s" in summary:  # embeddings: no output tokens
        rows += [["texts embedded (texts/s)", summary["texts_per_s"]],
                 ["prompt throughput (tok/s)", summary["prompt_tok_s"]]]
    else:
        rows += [["output throughput (tok/s)", summary["output_tok_s"]],
                 ["total throughput (tok/s)", summary["total_tok_s"]]]
    if "goodput_req_s" in summary:
        slos = " ".join(f"{k}:{v:g}" for k, v in summary["goodput_slos_ms"].items())
        rows.append([f"goodput (req/s, {slos} ms)", summary["goodput_req_s"]])
    for process in ("frontend", "engine"):  # a server this benchmark started
        if f"{process}_cpu_ms_per_token" in summary:
            rows.append([f"{process} CPU per output token (ms)", summary[f"{process}_cpu_ms_per_token"]])
    if summary["cached_tokens"]:
        rows.append(["prompt tokens from prefix cache", f"{summary['cached_tokens']} / {summary['prompt_tokens']}"])
    if offline:
        rows.append([f"offline, {offline['max_num_seqs']} seqs at most (tok/s)", offline["output_tok_s"]])
        rows.append(["offline, all prompts at once (tok/s)", offline["all_at_once"]["output_tok_s"]])
    print(f"\n{label}")
    print_table(["metric", "value"], rows)
    print()
    latency_rows = [[name.replace("_ms", "").upper() + " (ms)",
                     *(_cell(summary[f"{stat}_{name}"]) for stat in STATS)] for name in LATENCIES
                    if "texts_per_s" not in summary or name == "e2e_ms"]
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


def print_structured(whole: dict, groups: dict[str, dict], phases: dict | None) -> None:
    """The structured dataset's split of one run (`whole`: structured_summary's), then the
    engine's step phases."""
    print()
    print_table(GROUP_HEADER, [_group_row(name, g) for name, g in (("all", whole), *groups.items())])
    print("(TPOT in ms; a group's tok/s is its share of the run's; valid: parses and matches its schema)")
    for name, g in groups.items():
        print(f"{name}: finish reasons {g['finish_reasons']}; valid by task {g['num_valid_by_task']}")
    if phases is None:
        print("engine step phases: not measured (no engine /metrics: see --metrics-url)")
        return
    print()
    print_table(["engine step phase", "steps", "ms / step"],
                [[p, v["steps"], _cell(v["mean_ms"])] for p, v in phases.items()])
    print("(grammar: the bitmask fill and apply, in steps with a constrained row; part of sample)")


def print_structured_runs(runs: list[dict]) -> None:
    """One row per (ratio, group), then one per ratio with the step phases."""
    rows = [[f"{run['structured_ratio']:g}", *_group_row(name, g)] for run in runs
            for name, g in (("all", run["all"]), *run["groups"].items())]
    print()
    print_table(["ratio", *GROUP_HEADER], rows)
    phase_rows = [[f"{run['structured_ratio']:g}", *(_phase_cell(run["step_phases"], p) for p in PHASES)]
                  for run in runs]
    print()
    print_table(["ratio", *(f"{p} ms/step" for p in PHASES)], phase_rows)
    print("(TPOT in ms; a group's tok/s is its share of the run's; grammar's steps, in brackets, are those "
          "with a constrained row)")


def structured_summary(summary: dict, groups: dict[str, dict]) -> dict:
    """The whole run's summary with the fields each group adds."""
    done = sum(g["completed"] for g in groups.values())
    mean_len = sum(g["mean_output_len"] * g["completed"] for g in groups.values() if g["completed"])
    return {**summary, "mean_output_len": mean_len / done if done else None,
            **{k: sum(g[k] for g in groups.values()) for k in ("num_parsed", "num_valid")}}


def _group_row(name: str, g: dict) -> list:
    return [name, f"{g['completed']} / {g['failed']}", f"{g['num_parsed']} / {g['num_valid']}",
            _cell(g["mean_output_len"]), g["output_tok_s"], _cell(g["mean_tpot_ms"]), _cell(g["median_tpot_ms"]),
            _cell(g["p99_tpot_ms"])]


def _phase_cell(phases: dict | None, phase: str) -> str:
    if not phases or phases[phase]["mean_ms"] is None:
        return "n/a"
    text = f"{phases[phase]['mean_ms']:.3f}"
    return f"{text} ({phases[phase]['steps']})" if phase == "grammar" else text
