"""bench/vision.py's numbers, without a model: rows of timings turned into rates, medians and
the issue's verdicts, the printed tables, and the chart.

    encoder      images/s of pagedserve's embed_images vs HF's get_image_features on the
                 same pixels; target: ours >= 2x HF's (judged on the run's --dtype)
    ttft         one image, 1 output token: offline LLM.chat vs HF processor + generate
    prefix hit   the same image, a new question: TTFT of the hit / TTFT of the first
                 request (the miss); target <= 0.30
"""

from __future__ import annotations

import json
from pathlib import Path

from bench.reporting import median, name_plot, print_table

TARGETS = {"encoder_speedup": 2.0, "hit_to_miss": 0.30}


def encoder_row(dtype: str, size: int, batch: int, tokens: int, ours_s: list[float], hf_s: list[float],
                max_abs_diff: float, hf_max_abs: float) -> dict:
    """One encoder measurement: `batch` images of size x size pixels (`tokens` each) per call."""
    ours, hf = batch / median(ours_s), batch / median(hf_s)
    return {"dtype": dtype, "size": size, "batch": batch, "tokens_per_image": tokens,
            "ours_s": ours_s, "hf_s": hf_s, "ours_images_s": ours, "hf_images_s": hf, "speedup": ours / hf,
            "met": ours / hf >= TARGETS["encoder_speedup"],
            "max_abs_diff": max_abs_diff, "hf_max_abs": hf_max_abs}


def ttft_row(size: int, prompt_tokens: int, ours_s: list[float], hf_s: list[float]) -> dict:
    """TTFT of one image at size x size: ours and HF's, medians in ms; `speedup` HF / ours."""
    ours, hf = 1e3 * median(ours_s), 1e3 * median(hf_s)
    return {"size": size, "prompt_tokens": prompt_tokens, "ours_s": ours_s, "hf_s": hf_s,
            "ours_ms": ours, "hf_ms": hf, "speedup": hf / ours}


def hit_row(where: str, size: int, miss_s: list[float], hit_s: list[float], cached_tokens: int,
            prompt_tokens: int, encoder_skipped: bool | None) -> dict:
    """A repeated image with a new question (`where`: offline or http): the hit's TTFT over the
    miss's, medians. `encoder_skipped`: no image was encoded for the hits (None: unknown)."""
    miss, hit = 1e3 * median(miss_s), 1e3 * median(hit_s)
    return {"where": where, "size": size, "miss_s": miss_s, "hit_s": hit_s, "miss_ms": miss, "hit_ms": hit,
            "ratio": hit / miss, "met": hit / miss <= TARGETS["hit_to_miss"], "cached_tokens": cached_tokens,
            "prompt_tokens": prompt_tokens, "encoder_skipped": encoder_skipped}


def verdicts(encoder: list[dict], hits: list[dict], dtype: str) -> dict:
    """The issue's targets, each met only if every size meets it: the encoder on `dtype`'s rows,
    the hit on every row (offline and, where measured, over HTTP)."""
    judged = [r for r in encoder if r["dtype"] == dtype]
    return {"encoder_speedup": bool(judged) and all(r["met"] for r in judged),
            "hit_to_miss": bool(hits) and all(r["met"] for r in hits)}


def _mark(met: bool) -> str:
    return "met" if met else "MISSED"


def table_rows(payload: dict) -> list[list[object]]:
    """The main table: measure, pagedserve, HF, ratio, target, verdict."""
    rows = []
    for r in payload["encoder"]:
        rows.append([f"encoder images/s, {r['size']}px x{r['batch']}, {r['dtype']}", f"{r['ours_images_s']:.3f}",
                     f"{r['hf_images_s']:.3f}", f"{r['speedup']:.2f}x", f">= {TARGETS['encoder_speedup']:g}x",
                     _mark(r["met"])])
    for r in payload["ttft"]:
        rows.append([f"TTFT ms, 1 image {r['size']}px ({r['prompt_tokens']} tok)", f"{r['ours_ms']:.0f}",
                     f"{r['hf_ms']:.0f}", f"{r['speedup']:.2f}x", "(HF / ours)", ""])
    for r in payload["prefix_hit"]:
        rows.append([f"TTFT ms hit / miss, {r['size']}px, {r['where']}", f"{r['hit_ms']:.0f} / {r['miss_ms']:.0f}",
                     "-", f"{r['ratio']:.3f}", f"<= {TARGETS['hit_to_miss']:g}", _mark(r["met"])])
    for e in payload.get("served_errors") or []:
        rows.append([f"TTFT ms hit / miss, {e['size']}px, http", "request failed", "-", "-",
                     f"<= {TARGETS['hit_to_miss']:g}", "FAILED"])
    return rows


def print_report(payload: dict) -> None:
    print_table(["measure", "pagedserve", "HF transformers", "ratio", "target", "verdict"], table_rows(payload))
    agree = ", ".join(f"{r['size']}px {r['dtype']} {r['max_abs_diff']:.3g} (of |x| <= {r['hf_max_abs']:.3g})"
                      for r in payload["encoder"])
    print(f"encoder outputs, max |ours - HF|: {agree}")
    for r in payload["prefix_hit"]:
        skipped = {True: "skipped", False: "RAN", None: "unknown"}[r["encoder_skipped"]]
        print(f"hit {r['size']}px {r['where']}: {r['cached_tokens']} of {r['prompt_tokens']} prompt tokens "
              f"from the prefix cache, encoder {skipped}")
    if payload.get("served_note"):
        print(payload["served_note"])
    for e in payload.get("served_errors") or []:
        print(f"HTTP {e['size']}px FAILED (larger sizes not tried): {e['error']}; the server's last lines:\n  "
              + "  ".join(e["server_tail"]))
    if payload.get("profile"):
        print_profile(payload["profile"])


def print_profile(profile: dict) -> None:
    """Each encoder's time by part and its top ops."""
    for side in ("pagedserve", "HF"):
        print(f"\n{side}'s encoder, one {profile['size']}px image in {profile['dtype']}, by part:")
        print_table(["part", "ms", "share"], profile_rows(profile[side]["parts"]))
        print("top ops (self CPU ms, calls): " + ", ".join(
            f"{op} {ms:.0f} ({profile[side]['op_calls'][op]})" for op, ms in profile[side]["ops"].items()))


def profile_rows(parts: dict[str, float]) -> list[list[object]]:
    """A profile's parts (ms; "total" among them), largest first, with their share of the total."""
    total = parts["total"]
    rows = sorted(((k, v) for k, v in parts.items() if k != "total"), key=lambda kv: -kv[1])
    return [[k, f"{v:.0f}", f"{100 * v / total:.0f}%"] for k, v in rows] + [["total", f"{total:.0f}", "100%"]]


def plot(path: Path) -> Path:
    """Three panels from the result file: encoder images/s, TTFT by size (ours vs HF), and the
    hit's TTFT over the miss's against the target; a .png beside it, named in it."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from bench.plots import save_figure
    payload = json.loads(path.read_text())
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    enc = payload["encoder"]
    _pairs(axes[0], [f"{r['size']}px x{r['batch']}\n{r['dtype']}" for r in enc],
           [r["ours_images_s"] for r in enc], [r["hf_images_s"] for r in enc], "%.2f")
    axes[0].set_title(f"encoder images/s (higher is better; target ours >= "
                      f"{TARGETS['encoder_speedup']:g}x HF)", fontsize=9)
    ttft = payload["ttft"]
    _pairs(axes[1], [f"{r['size']}px" for r in ttft], [r["ours_ms"] for r in ttft], [r["hf_ms"] for r in ttft], "%.0f")
    axes[1].set_title("TTFT ms, one image, fresh caches (lower is better)", fontsize=9)
    hits, failed = payload["prefix_hit"], payload.get("served_errors") or []
    bars = axes[2].bar(range(len(hits)), [r["ratio"] for r in hits],
                       color=["tab:blue" if r["met"] else "tab:red" for r in hits])
    axes[2].bar_label(bars, fmt="%.3f", fontsize=8, padding=2)
    for i in range(len(hits), len(hits) + len(failed)):  # a request that failed: no bar, a word
        axes[2].text(i, 0.01, "request\nfailed", ha="center", fontsize=8, color="tab:red")
    axes[2].set_xlim(-0.6, len(hits) + len(failed) - 0.4)
    axes[2].axhline(TARGETS["hit_to_miss"], color="black", linestyle="--", linewidth=1, label="target")
    axes[2].set_xticks(range(len(hits) + len(failed)), [f"{r['size']}px\n{r['where']}" for r in hits]
                       + [f"{e['size']}px\nhttp" for e in failed], fontsize=8)
    axes[2].set_title("TTFT of a prefix-cache hit / miss (lower is better)", fontsize=9)
    axes[2].legend(fontsize=8)
    for ax in axes:
        ax.grid(True, axis="y", alpha=0.3)
        ax.margins(y=0.15)
    model = payload["model"]
    fig.suptitle(f"Qwen2.5-VL-3B widths, vision depth {model['vision_depth']}, {model['text_layers']} LM layers, "
                 f"random weights; {payload['machine']['cpu']}, {payload['workload']['num_threads']} threads",
                 fontsize=9)
    return name_plot(path, save_figure(fig, path.with_suffix(".png")))


def _pairs(ax, labels: list[str], ours: list[float], hf: list[float], fmt: str) -> None:
    """Grouped bars: pagedserve (blue) and HF (gray) per label."""
    x = range(len(labels))
    for offset, values, color, name in ((-0.2, ours, "tab:blue", "pagedserve"), (0.2, hf, "tab:gray", "HF")):
        bars = ax.bar([i + offset for i in x], values, 0.4, color=color, label=name)
        ax.bar_label(bars, fmt=fmt, fontsize=8, padding=2)
    ax.set_xticks(list(x), labels, fontsize=8)
    ax.legend(fontsize=8)
