"""What `bench scaling` prints and writes: one table, scaling-<stamp>.json and its PNG."""

from __future__ import annotations

import argparse
from pathlib import Path

from bench.plots import save_figure
from bench.reporting import machine_info, print_table, write_result

HEADER = ["engines", "routing", "conc", "ok / failed", "out tok/s", "efficiency", "TTFT p50", "TTFT p99", "TPOT p50",
          "cores busy", "engine CPU ms/tok", "frontend", "client", "token split", "prefix hit"]
ROLES = ("engines", "frontend", "client")


def derive(runs: list[dict]) -> list[dict]:
    """Per run: efficiency against the first count, CPU ms per output token by role, cores busy."""
    base = runs[0]
    base_per_engine = base["summary"]["output_tok_s"] / base["engines"]
    out = []
    for r in runs:
        s = r["summary"]
        tokens = max(1, s["output_tokens"])
        engine_s = sum(v for k, v in r["cpu_s"].items() if k.startswith("engine"))
        by_role = {"engines": engine_s, "frontend": r["cpu_s"]["frontend"], "client": r["cpu_s"]["client"]}
        counters = r["engine_counters"]
        total_tokens = sum(c["generation_tokens"] for c in counters) or 1
        queries = sum(c["prefix_cache_queries"] for c in counters)
        out.append({
            "efficiency": s["output_tok_s"] / (r["engines"] * base_per_engine) if base_per_engine else None,
            "cpu_ms_per_token": {role: 1000 * v / tokens for role, v in by_role.items()},
            "cpu_ms_per_token_per_engine": {k: 1000 * v / tokens for k, v in r["cpu_s"].items()
                                            if k.startswith("engine")},
            "cores_busy": {role: v / s["duration_s"] for role, v in by_role.items()},
            "engine_token_share": [c["generation_tokens"] / total_tokens for c in counters],
            "prefix_cache_hit_rate": sum(c["prefix_cache_hits"] for c in counters) / queries if queries else None,
        })
    return out


def report(runs: list[dict], commands: dict, base, args: argparse.Namespace) -> Path:
    derived = derive(runs)
    rows = []
    for r, d in zip(runs, derived):
        s = r["summary"]
        rows.append([r["engines"], r["routing_policy"] if r["engines"] > 1 else "-", r["concurrency"], f"{s['completed']} / {s['failed']}", s["output_tok_s"],
                     d["efficiency"], s["median_ttft_ms"], s["p99_ttft_ms"], s["median_tpot_ms"],
                     sum(d["cores_busy"].values()), d["cpu_ms_per_token"]["engines"],
                     d["cpu_ms_per_token"]["frontend"], d["cpu_ms_per_token"]["client"],
                     " / ".join(f"{x:.0%}" for x in d["engine_token_share"]),
                     "-" if d["prefix_cache_hit_rate"] is None else f"{d['prefix_cache_hit_rate']:.0%}"])
    print()
    print_table(HEADER, rows)
    print(f"(ms; efficiency: out tok/s over {runs[0]['engines']} engine(s)' per-engine figure × engines; cores "
          "busy: CPU seconds of engines + frontend + client per second; CPU ms/tok: each role's CPU per output "
          "token; token split: each engine's share of the generated tokens; prefix hit: prompt tokens the engines' "
          "prefix caches served over those they looked up; both from the engines' /metrics)")
    machine = machine_info(base.device)
    payload = {
        "machine": machine, "model": runs[0]["model"], "engine_config": vars(base),
        "engine_threads": base.num_threads,
        "workload": {"dataset": args.dataset, "input_len": args.input_len, "output_len": args.output_len,
                     **({"prefix_len": args.prefix_len, "num_prefixes": args.num_prefixes}
                        if args.dataset == "prefix" else {}),
                     "prompts_per_engine": args.prompts_per_engine,
                     "concurrency_per_engine": args.concurrency_per_engine, "seed": args.seed},
        "commands": {str(n): c for n, c in commands.items()},
        "runs": [{k: v for k, v in r.items() if k != "model"} | d for r, d in zip(runs, derived)],
    }
    path = write_result("scaling", payload, args.output_dir)
    title = (f"{runs[0]['model'].get('model_name', '?')}, {base.num_threads} thread(s) per engine, "
             f"one frontend\n{machine['cpu']}, {machine['num_cpus']} CPUs")
    plot_scaling(runs, derived, title, path.with_suffix(".png"))
    print(f"wrote {path} and {path.with_suffix('.png').name}")
    return path


def plot_scaling(runs: list[dict], derived: list[dict], title: str, path: Path) -> Path:
    """Left: output tok/s per engine count against linear scaling. Right: CPU ms per output
    token, stacked by role."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [str(r["engines"]) if r["engines"] == 1 else f"{r['engines']}\n{r['routing_policy']}" for r in runs]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    tput = [r["summary"]["output_tok_s"] for r in runs]
    bars = left.bar(labels, tput, color="tab:blue", label="measured")
    per_engine = tput[0] / runs[0]["engines"]
    left.plot(labels, [per_engine * r["engines"] for r in runs], "k_", markersize=40, mew=2, label="linear")
    left.bar_label(bars, labels=[f"{t:.0f}\n({d['efficiency']:.2f})" for t, d in zip(tput, derived)],
                   label_type="center", color="white")
    left.set_xlabel("engines")
    left.set_ylabel("output tokens / s (efficiency)")
    left.legend(loc="upper left")
    left.margins(y=0.25)
    bottom = [0.0] * len(runs)
    for i, role in enumerate(ROLES):
        values = [d["cpu_ms_per_token"][role] for d in derived]
        right.bar(labels, values, bottom=bottom, color=f"C{i}", label=role)
        bottom = [b + v for b, v in zip(bottom, values)]
    right.set_xlabel("engines")
    right.set_ylabel("CPU ms per output token")
    right.legend()
    fig.suptitle(title, fontsize=9)
    return save_figure(fig, path)
