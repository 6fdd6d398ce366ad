"""Charts for benchmark results (matplotlib, headless)."""

from __future__ import annotations

from pathlib import Path


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
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
