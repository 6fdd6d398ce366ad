"""bench/cpu_arithmetic.py's numbers, without a model: perplexity from prompt logprobs, KL
divergence against HF float32's next-token distributions, greedy agreement, issue 49's rule,
the printed table and the chart.

Issue 49's rule: the plan may choose the integer arithmetic (int8) by default only where its
perplexity is within PPL_TOLERANCE of float32's and its greedy agreement with HF float32 is at
least as high as bf16's on the same prompts. "float32's" is our float32 arithmetic (the exact
products); "bf16's" is every bf16 arithmetic measured in the run (AVX512-BF16, AMX): int8 must
reach the best of them, on both measures of agreement (whole outputs equal, leading tokens).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path

from bench.reporting import name_plot, print_table

PPL_TOLERANCE = 0.005  # issue 49: int8's perplexity within 0.5% of float32's
INTEGER = ("int8",)  # the arithmetics the rule judges
BF16 = ("avx512_bf16", "amx", "bfloat16")  # what int8 is compared with ("bfloat16": no bf16 kernel here)
RULE = ("the plan may choose int8 by default only where its perplexity is within 0.5% of float32's and greedy "
        "agreement is at least as high as bf16's on that prompt set")


def perplexity(target_logprobs: Sequence[float]) -> float:
    """exp of the mean negative logprob of each scored token."""
    return math.exp(-sum(target_logprobs) / len(target_logprobs))


def kl_divergence(reference, ours, chunk_rows: int = 256):
    """KL(reference || ours) per row, float64 [T]: both are log-probabilities (or logits) [T, V]
    over the same vocabulary (the reference is HF float32's). Each row is normalized again in
    float64: float32 log-probabilities sum to 1 only within rounding, enough to make a KL of
    nearly equal rows come out negative. In chunks of rows: a [T, V] float64 temporary of a 49k
    vocabulary is ~400 MB."""
    import torch
    if reference.shape != ours.shape:
        raise ValueError(f"logprobs of shape {tuple(ours.shape)} against the reference's {tuple(reference.shape)}")
    out = []
    for a in range(0, reference.shape[0], chunk_rows):
        ref = torch.log_softmax(reference[a:a + chunk_rows].double(), dim=-1)
        our = torch.log_softmax(ours[a:a + chunk_rows].double(), dim=-1)
        # kl_div(input=log q, target=log p, log_target) = p (log p - log q); p = 0 adds 0
        out.append(torch.nn.functional.kl_div(our, ref, reduction="none", log_target=True).sum(-1))
    return torch.cat(out)


def kl_summary(kl) -> dict:
    """Mean, 99th percentile and max of per-position KL divergences (nats)."""
    import torch
    kl = kl.double()
    return {"mean": kl.mean().item(), "p99": torch.quantile(kl, 0.99).item(), "max": kl.max().item()}


def leading_agreement(ours: Sequence[int], reference: Sequence[int]) -> int:
    """How many tokens from the start agree before the first difference."""
    n = 0
    for a, b in zip(ours, reference):
        if a != b:
            break
        n += 1
    return n


def greedy_agreement(ours: Sequence[Sequence[int]], reference: Sequence[Sequence[int]]) -> dict:
    """`exact`: the share of prompts whose whole output equals the reference's; `leading`: the
    mean share of each reference output's tokens that agree from the start."""
    if len(ours) != len(reference) or not reference:
        raise ValueError(f"{len(ours)} outputs against {len(reference)} reference outputs")
    exact = sum(list(a) == list(b) for a, b in zip(ours, reference)) / len(reference)
    leading = sum(leading_agreement(a, b) / len(b) for a, b in zip(ours, reference)) / len(reference)
    return {"exact": exact, "leading": leading}


def verdicts(results: dict[str, dict]) -> dict[str, dict]:
    """Issue 49's rule for each integer arithmetic in `results` (name -> {"perplexity",
    "greedy": greedy_agreement's}), judged against "float32" and the BF16 arithmetics there;
    `may_be_default` is False, with a reason, where one of them did not run."""
    bf16 = [results[n]["greedy"] for n in BF16 if n in results]
    out = {}
    for name in (n for n in INTEGER if n in results):
        r = results[name]
        if "float32" not in results or not bf16:
            out[name] = {"may_be_default": False, "reason": "float32 or a bf16 arithmetic did not run"}
            continue
        change = r["perplexity"] / results["float32"]["perplexity"] - 1
        best = {key: max(g[key] for g in bf16) for key in ("exact", "leading")}
        ppl_ok = abs(change) <= PPL_TOLERANCE
        greedy_ok = all(r["greedy"][key] >= best[key] for key in best)
        out[name] = {"ppl_vs_float32_pct": 100 * change, "ppl_within": ppl_ok, "bf16_best_greedy": best,
                     "greedy_at_least_bf16": greedy_ok, "may_be_default": ppl_ok and greedy_ok}
    return out


def table_rows(results: dict[str, dict], hf_perplexity: float) -> list[list[object]]:
    rows = [["HF float32", "-", f"{hf_perplexity:.4f}", "1.0000", "0.000%", "0", "0", "100%", "100%"]]
    for name, r in results.items():
        ratio = r["perplexity"] / hf_perplexity
        rows.append([name, r["plan"], f"{r['perplexity']:.4f}", f"{ratio:.4f}", f"{100 * (ratio - 1):+.3f}%",
                     f"{r['kl']['mean']:.2e}", f"{r['kl']['p99']:.2e}", f"{100 * r['greedy']['exact']:.0f}%",
                     f"{100 * r['greedy']['leading']:.1f}%"])
    return rows


def print_report(results: dict[str, dict], hf_perplexity: float, judged: dict[str, dict]) -> None:
    print_table(["arithmetic", "kernels", "perplexity", "ppl / HF", "ppl vs HF", "KL mean", "KL p99",
                 "greedy equal", "leading agree"], table_rows(results, hf_perplexity))
    print(f"\nissue 49: {RULE}")
    for name, v in judged.items():
        if "reason" in v:
            print(f"  {name}: not judged ({v['reason']})")
            continue
        best = v["bf16_best_greedy"]
        print(f"  {name}: perplexity {v['ppl_vs_float32_pct']:+.3f}% of float32's "
              f"({'within' if v['ppl_within'] else 'NOT within'} {100 * PPL_TOLERANCE:g}%); greedy "
              f"{'at least' if v['greedy_at_least_bf16'] else 'BELOW'} bf16's best ({100 * best['exact']:.0f}% "
              f"equal, {100 * best['leading']:.1f}% leading) -> "
              f"{'may be the default' if v['may_be_default'] else 'stays opt-in'}")


def plot(path: Path) -> Path:
    """Three panels from the result file: perplexity against HF float32's (%), KL mean and p99,
    greedy agreement; a .png beside it, named in it."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from bench.plots import save_figure
    payload = json.loads(path.read_text())
    results, hf = payload["results"], payload["hf_float32"]["perplexity"]
    names = list(results)
    fig, axes = plt.subplots(1, 3, figsize=(14, 4.2))
    bars = axes[0].bar(names, [100 * (results[n]["perplexity"] / hf - 1) for n in names], color="tab:blue")
    axes[0].bar_label(bars, fmt="%+.3f", fontsize=8, padding=2)
    axes[0].axhline(0, color="black", linewidth=0.8)
    axes[0].set_title(f"perplexity vs HF float32's {hf:.3f} (%)", fontsize=9)
    _pairs(axes[1], names, [results[n]["kl"]["mean"] for n in names], [results[n]["kl"]["p99"] for n in names],
           ("mean", "p99"), "%.1e")
    axes[1].set_yscale("log")
    axes[1].set_title("KL(HF float32 || ours), nats per position (lower is better)", fontsize=9)
    _pairs(axes[2], names, [100 * results[n]["greedy"]["exact"] for n in names],
           [100 * results[n]["greedy"]["leading"] for n in names], ("whole output equal", "leading tokens"), "%.0f")
    axes[2].set_title(f"greedy agreement with HF float32, {payload['workload']['num_prompts']} prompts x "
                      f"{payload['workload']['output_len']} tokens (%)", fontsize=9)
    for ax in axes:
        ax.grid(True, axis="y", alpha=0.3)
        ax.tick_params(axis="x", labelsize=8)
    fig.suptitle(f"{Path(payload['model']).name}; {payload['machine']['cpu']}, "
                 f"{payload['workload']['num_threads']} threads", fontsize=9)
    return name_plot(path, save_figure(fig, path.with_suffix(".png")))


def _pairs(ax, labels: list[str], first: list[float], second: list[float], legend: tuple[str, str],
           fmt: str) -> None:
    x = range(len(labels))
    for offset, values, color, name in ((-0.2, first, "tab:blue", legend[0]), (0.2, second, "tab:gray", legend[1])):
        bars = ax.bar([i + offset for i in x], values, 0.4, color=color, label=name)
        ax.bar_label(bars, fmt=fmt, fontsize=7, padding=2)
    ax.set_xticks(list(x), labels)
    ax.legend(fontsize=8)
