"""What `bench spec` prints and writes: one table, spec-decode-<stamp>.json and its PNG."""

from __future__ import annotations

import argparse
import math
import statistics
from dataclasses import asdict
from pathlib import Path

from bench.plots import save_figure
from bench.reporting import machine_info, name_plot, print_table, write_result
from bench.serve_metrics import tpot_ms

HEADER = ["workload", "conc", "config", "ok / failed", "out len", "TPOT p50", "TPOT mean", "TTFT p50", "out tok/s",
          "accept rate", "accept len", "TPOT speed-up", "same as off"]


def report(runs: list, compared: list[dict], requests: dict, commands: dict[str, list[str]], model: dict, base,
           args: argparse.Namespace) -> Path:
    """`runs`: bench.spec_decode's Run list; `compared`: its compare() of them."""
    rows = [_row(r, c) for r, c in zip(runs, compared)]
    print()
    print_table(HEADER, [[row[h] for h in HEADER] for row in rows])
    print("(ms; out len: mean tokens per reply; accept len: tokens per verification step, 1 + accepted / drafts; "
          "TPOT speed-up: off's TPOT p50 / this one's; same as off: replies token for token off's)")
    _print_positions(rows)
    machine = machine_info(base.device)
    payload = {
        "machine": machine, "model": model, "engine_config": vars(base), "server_commands": commands,
        "configs": list(commands), "seed": args.seed,
        "workloads": {w: _dataset(w, [r for (wl, _), rs in requests.items() if wl == w for r in rs], args)
                      for w in dict.fromkeys(w for w, _ in requests)},
        "runs": [{**row["json"], "requests": [_request_json(rec) for rec in run.records]}
                 for row, run in zip(rows, runs)],
    }
    path = write_result("spec-decode", payload, args.output_dir)
    title = (f"{model.get('model_name', '?')} ({model.get('dtype', '?')}), speculative decoding, "
             f"K={base.num_speculative_tokens}\n{machine['cpu']}, {machine['num_cpus']} CPUs "
             f"({' '.join(machine['cpu_flags'])})")
    chart = plot_spec([row["json"] for row in rows], title, path.with_suffix(".png"))
    name_plot(path, chart)
    print(f"\nwrote {path} and {chart.name}")
    return path


def _row(run, compared: dict) -> dict:
    s, a = run.summary, run.acceptance or {}
    data = {"workload": run.workload, "concurrency": run.concurrency, "config": run.config,
            "num_prompts": len(run.records), **s, "acceptance": run.acceptance, **compared}
    same = compared["same_as_off"]
    return {"workload": run.workload, "conc": run.concurrency, "config": run.config,
            "ok / failed": f"{s['completed']} / {s['failed']}", "out len": _cell(s["mean_output_len"]),
            "TPOT p50": _cell(s["median_tpot_ms"]), "TPOT mean": _cell(s["mean_tpot_ms"]),
            "TTFT p50": _cell(s["median_ttft_ms"]), "out tok/s": s["output_tok_s"],
            "accept rate": _cell(a.get("acceptance_rate")), "accept len": _cell(a.get("mean_acceptance_length")),
            "TPOT speed-up": "n/a" if compared["tpot_speedup"] is None else f"{compared['tpot_speedup']:.2f}x",
            "same as off": ("-" if run.config == "off" else "n/a") if same is None else f"{same}/{s['completed']}",
            "json": data}


def _print_positions(rows: list[dict]) -> None:
    rates = [(row, row["json"]["acceptance"]["acceptance_rate_per_pos"]) for row in rows
             if (row["json"]["acceptance"] or {}).get("acceptance_rate_per_pos")]
    if not rates:
        print("acceptance: n/a (the engine's /metrics had no pagedserve:spec_decode_* counters, or no drafts)")
        return
    width = max(len(r) for _, r in rates)
    print()
    print_table(["workload", "conc", "config", *(f"pos {i}" for i in range(width))],
                [[row["workload"], row["conc"], row["config"], *(r + ["n/a"] * (width - len(r)))]
                 for row, r in rates])
    print("(acceptance rate by draft position: accepted at that position / verification steps with drafts)")


def _dataset(workload: str, requests: list, args: argparse.Namespace) -> dict:
    common = {"num_requests": len(requests), "mean_prompt_len": statistics.fmean(r.prompt_len for r in requests),
              "mean_max_tokens": statistics.fmean(r.output_len for r in requests),
              "max_output_len": args.max_output_len}
    if workload == "edit":
        return {**common, "path": "bench/data/edit_tasks.json", "output_ratio": args.edit_output_ratio,
                "eos": "honoured", "distinct_tasks": len({r.task for r in requests})}
    return {**common, "input_len": args.random_input_len, "output_len": args.random_output_len, "eos": "ignored"}


def _request_json(record) -> dict:
    out = {k: v for k, v in asdict(record).items() if k not in ("token_times_s", "token_ids")}
    tpot = tpot_ms(record)
    out.update({"num_output_tokens": record.num_output_tokens, "tpot_ms": tpot})
    return {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in out.items()}


def _cell(value: float | None) -> object:
    return "n/a" if value is None else value


def plot_spec(runs: list[dict], title: str, path: Path) -> Path:
    """Grouped bars of TPOT p50, one group per (workload, concurrency) and a color per config,
    each labelled with its speed-up over off; output tok/s the same way beside it."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = list(dict.fromkeys((r["workload"], r["concurrency"]) for r in runs))
    configs = list(dict.fromkeys(r["config"] for r in runs))
    width = 0.8 / len(configs)
    fig, axes = plt.subplots(1, 2, figsize=(max(8, 2.2 * len(groups) * 2), 4.8))
    for ax, key, label in ((axes[0], "median_tpot_ms", "TPOT p50, ms (lower is better)"),
                           (axes[1], "output_tok_s", "output tokens / s (higher is better)")):
        for i, config in enumerate(configs):
            points = [(groups.index((r["workload"], r["concurrency"])) + (i - (len(configs) - 1) / 2) * width, r)
                      for r in runs if r["config"] == config and r.get(key) is not None]
            bars = ax.bar([x for x, _ in points], [r[key] for _, r in points], width, color=f"C{i}", label=config)
            if key == "median_tpot_ms":
                ax.bar_label(bars, [_speedup_label(r) for _, r in points], fontsize=7, padding=2)
            else:
                ax.bar_label(bars, fmt="%.0f", fontsize=7, padding=2)
        ax.set_xticks(range(len(groups)), [f"{w}\nconcurrency {c}" for w, c in groups], fontsize=8)
        ax.set_title(label, fontsize=10)
        ax.grid(True, axis="y", alpha=0.3)
        ax.margins(y=0.15)
    axes[0].legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    return save_figure(fig, path)


def _speedup_label(run: dict) -> str:
    tpot = f"{run['median_tpot_ms']:.1f}"
    return tpot if run["config"] == "off" or run["tpot_speedup"] is None else f"{tpot}\n{run['tpot_speedup']:.2f}x"
