"""Charts for benchmark results (matplotlib, headless)."""

from __future__ import annotations

from pathlib import Path


def save_figure(fig, path: Path, dpi: int = 120) -> Path:
    """Lay out, write and close a benchmark's figure; returns its path."""
    import matplotlib.pyplot as plt
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return path


def plot_offline(results: dict, title: str, path: Path) -> Path:
    """Horizontal bars: output tokens/s of the engine and of each HF baseline."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [(name.replace("_", " "), r["output_tok_s"]) for name, r in results.items() if "output_tok_s" in r]
    rows.sort(key=lambda row: row[1])
    fig, ax = plt.subplots(figsize=(7, 0.5 * len(rows) + 1.2))
    colors = ["tab:blue" if name.startswith("engine") else "tab:gray" for name, _ in rows]
    bars = ax.barh([n for n, _ in rows], [v for _, v in rows], color=colors)
    ax.bar_label(bars, fmt="%.0f", padding=3)
    ax.set_xlabel("output tokens / s (higher is better)")
    ax.set_title(title, fontsize=10)
    ax.margins(x=0.15)
    return save_figure(fig, path)


SWEEP_PANELS = (("median_ttft_ms", "TTFT p50"), ("p99_ttft_ms", "TTFT p99"),
                ("median_tpot_ms", "TPOT p50"), ("p99_tpot_ms", "TPOT p99"))


def plot_sweep(runs: list[dict], title: str, path: Path) -> Path:
    """Latency against achieved output throughput, one line per backend, 2x2 panels.

    `runs`: one dict per run with "backend", "request_rate" (a label: "2", "inf") and the
    summary keys of SWEEP_PANELS plus "output_tok_s". Points are joined in rate order, so
    each line is the backend's throughput-latency curve; each point is labelled with its rate.
    """
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, NullFormatter

    fig, axes = plt.subplots(2, 2, figsize=(11, 8), sharex=True)
    backends = list(dict.fromkeys(r["backend"] for r in runs))
    for ax, (key, label) in zip(axes.flat, SWEEP_PANELS):
        for i, backend in enumerate(backends):
            points = [(r["output_tok_s"], r[key], r["request_rate"]) for r in runs
                      if r["backend"] == backend and r.get(key) is not None]
            if not points:
                continue
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", color=f"C{i}", label=backend)
            for x, y, rate in points:
                ax.annotate(rate if rate == "inf" else f"{rate}/s", (x, y), textcoords="offset points",
                            xytext=(4, 4), fontsize=7)
        ax.set_yscale("log")
        plain = FuncFormatter(lambda value, _: f"{value:g}")  # 200, not 2x10^2
        ax.yaxis.set_major_formatter(plain)
        low, high = ax.get_ylim()
        # Within a decade only minor ticks carry numbers; over several they would overlap.
        ax.yaxis.set_minor_formatter(plain if high < 10 * low else NullFormatter())
        ax.set_title(f"{label} (lower is better)", fontsize=10)
        ax.set_ylabel("ms")
        ax.grid(True, which="both", alpha=0.3)
    for ax in axes[1]:
        ax.set_xlabel("achieved output throughput (tok/s)")
    axes.flat[0].legend()
    fig.suptitle(title, fontsize=10)
    return save_figure(fig, path)


def plot_soak(samples: list[dict], warmup_s: float, title: str, path: Path) -> Path:
    """Three panels over time: RSS of both processes, KV-cache usage, requests by outcome."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    minutes = [s["t_s"] / 60 for s in samples]
    fig, (rss, kv, done) = plt.subplots(3, 1, figsize=(8, 8), sharex=True)
    for key, label in (("engine_rss_mb", "engine"), ("frontend_rss_mb", "frontend")):
        rss.plot(minutes, [s[key] for s in samples], label=label)
    rss.set_ylabel("RSS (MiB)")
    rss.legend(loc="center right")
    kv.plot(minutes, [100 * s["kv_usage"] for s in samples], color="tab:green")
    kv.set_ylabel("KV cache used (%)")
    kv.set_ylim(0, 100)
    for key in ("ok", "cancelled", "deadline", "unexpected"):
        done.plot(minutes, [s[key] for s in samples], label=key)
    done.set_ylabel("requests (cumulative)")
    done.set_xlabel("minutes")
    done.legend(loc="upper left")
    for ax in (rss, kv, done):
        ax.axvspan(0, warmup_s / 60, color="0.9", zorder=0)  # warm-up: not judged
        ax.grid(alpha=0.3)
    fig.suptitle(title, fontsize=9)
    return save_figure(fig, path, dpi=110)


def plot_kernels(rows: list[dict], title: str, path: Path) -> Path:
    """Decode attention: % of copy bandwidth against context, a line per batch size, one
    panel per head layout; the heuristic's kernel choice (solid) and the other (dotted)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layouts = list(dict.fromkeys(r["heads"] for r in rows))
    fig, axes = plt.subplots(1, len(layouts), figsize=(6 * len(layouts), 4.5), sharey=True, squeeze=False)
    for ax, layout in zip(axes[0], layouts):
        batches = sorted({r["batch"] for r in rows if r["heads"] == layout})
        for i, batch in enumerate(batches):
            points = [r for r in rows if r["heads"] == layout and r["batch"] == batch and "pct" in r]
            if not points:
                continue
            ax.plot([r["context"] for r in points], [r["pct"] for r in points], marker="o", color=f"C{i}",
                    label=f"batch {batch}")
            other = [(r["context"], r[f"{k}_pct"]) for r in points
                     for k in ("single", "split") if k != r["heuristic"] and f"{k}_pct" in r]
            if other:
                ax.plot(*zip(*other), linestyle=":", color=f"C{i}", alpha=0.6)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context length (tokens)")
        ax.set_title(layout, fontsize=10)
        ax.grid(True, alpha=0.3)
    axes[0][0].set_ylabel("% of device-to-device copy bandwidth")
    axes[0][0].legend(fontsize=8)
    fig.suptitle(title + " (solid: heuristic's kernel; dotted: the other)", fontsize=10)
    return save_figure(fig, path)


PEER_PANELS = (("output_tok_s", None, "output tokens / s (higher is better)"),
               ("median_ttft_ms", "p99_ttft_ms", "TTFT ms, median (bar) and p99 (tick)"),
               ("median_tpot_ms", "p99_tpot_ms", "TPOT ms, median (bar) and p99 (tick)"))


def plot_peers(rows: list[dict], title: str, path: Path) -> Path:
    """Grouped bars, one group per concurrency and one color per peer, for each PEER_PANELS
    metric; `rows` are bench.compare_peers' (peer, concurrency, and the summary keys)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    peers = list(dict.fromkeys(r["peer"] for r in rows))
    levels = sorted({r["concurrency"] for r in rows})
    width = 0.8 / max(1, len(peers))
    fig, axes = plt.subplots(1, len(PEER_PANELS), figsize=(5 * len(PEER_PANELS), 4.5))
    for ax, (key, tick_key, label) in zip(axes, PEER_PANELS):
        for i, peer in enumerate(peers):
            points = [(levels.index(r["concurrency"]) + (i - (len(peers) - 1) / 2) * width, r)
                      for r in rows if r["peer"] == peer and r.get(key) is not None]
            if not points:
                continue
            bars = ax.bar([x for x, _ in points], [r[key] for _, r in points], width, color=f"C{i}", label=peer)
            ax.bar_label(bars, fmt="%.0f" if key == "output_tok_s" else "%.1f", fontsize=7, padding=2)
            if tick_key:
                ax.scatter([x for x, _ in points], [r[tick_key] for _, r in points], marker="_", s=200,
                           color="black", zorder=3)
        if tick_key:
            ax.set_yscale("log")  # concurrency 1 and 32 differ by orders of magnitude
        ax.set_xticks(range(len(levels)), [f"concurrency {c}" for c in levels])
        ax.set_title(label, fontsize=10)
        ax.grid(True, axis="y", alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    return save_figure(fig, path)


def plot_host_step(payload: dict, path: Path) -> Path:
    """Stacked bars per build: the model's ms per timed step, the engine's host ms on top,
    and the output processing beside them."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(payload["results"])
    runs = [payload["results"][n] for n in names]
    labels = [f"{n}\n{r['commit'][:8]}" for n, r in zip(names, runs)]
    fig, ax = plt.subplots(figsize=(7, 0.8 * len(names) + 1.4))
    ax.barh(labels, [r["forward_ms"] for r in runs], color="tab:gray", label="model (forward + LM head)")
    host = ax.barh(labels, [r["host_ms"] for r in runs], left=[r["forward_ms"] for r in runs],
                   color="tab:red", label="engine host work")
    ax.bar_label(host, labels=[f"host {r['host_ms']:.2f} ms" for r in runs], padding=3)
    workload = payload["workload"]
    ax.set_xlabel(f"ms per {workload.get('phase', 'decode')} step at {workload['num_seqs']} sequences "
                  "(lower is better)")
    ax.set_title("Engine step: model vs host time (output processing apart: "
                 + ", ".join(f"{n} {r['output_ms']:.2f} ms" for n, r in zip(names, runs)) + ")", fontsize=9)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.3), ncol=2, fontsize=8)
    ax.margins(x=0.3)
    return save_figure(fig, path)


def plot_embeddings(results: dict, title: str, path: Path) -> Path:
    """Two panels: texts/s of every run (pagedserve blue, sentence-transformers gray), and the
    server's E2E latency with one text a request (p50, p90, p99); `results` are bench.embeddings'."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [(f"sentence-transformers {r['dtype']}, batch {r['batch_size']}" if name.startswith("st_")
             else f"pagedserve {name} ({r['dtype']})", r["texts_per_s"]) for name, r in results.items()
            if name != "server_latency"]
    latency = results.get("server_latency")
    fig, (bars_ax, lat_ax) = plt.subplots(1, 2, figsize=(12, 0.45 * len(rows) + 2),
                                          gridspec_kw={"width_ratios": [3, 1]})
    colors = ["tab:gray" if name.startswith("sentence") else "tab:blue" for name, _ in rows]
    bars = bars_ax.barh([n for n, _ in rows], [v for _, v in rows], color=colors)
    bars_ax.bar_label(bars, fmt="%.0f", padding=3)
    bars_ax.invert_yaxis()
    bars_ax.set_xlabel("texts / s (higher is better)")
    bars_ax.margins(x=0.15)
    if latency:
        stats = [("p50", "median_e2e_ms"), ("p90", "p90_e2e_ms"), ("p99", "p99_e2e_ms")]
        lat_bars = lat_ax.bar([s for s, _ in stats], [latency[k] for _, k in stats], color="tab:blue")
        lat_ax.bar_label(lat_bars, fmt="%.0f", padding=2)
        lat_ax.set_title(f"server, one text a request,\n{latency['clients']} clients ({latency['dtype']})",
                         fontsize=9)
        lat_ax.set_ylabel("E2E ms (lower is better)")
        lat_ax.margins(y=0.15)
    else:
        lat_ax.set_axis_off()
    fig.suptitle(title, fontsize=9)
    return save_figure(fig, path)


def plot_panels(values: dict[str, dict[str, float]], panels: list[tuple[str, str]], title: str, path: Path) -> Path:
    """One bar chart per panel (key, label), a bar per series: values[series][key]. For a
    benchmark that compares a few configurations on a few unrelated metrics."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = list(values)
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.8))
    for ax, (key, label) in zip(axes, panels):
        bars = ax.bar(range(len(series)), [values[s].get(key) or 0 for s in series],
                      color=[f"C{i}" for i in range(len(series))])
        ax.bar_label(bars, fmt="%.1f", fontsize=8, padding=2)
        ax.set_xticks(range(len(series)), series, fontsize=8, rotation=15)
        ax.set_title(label, fontsize=10)
        ax.margins(y=0.15)
        ax.grid(True, axis="y", alpha=0.3)
    fig.suptitle(title, fontsize=9)
    return save_figure(fig, path)
