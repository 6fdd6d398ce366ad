"""`python -m bench.kv_offload`: a long shared prefix served from the prefix cache's second
tier (--kv-offload-gb) against recomputing it, through a real server, in one run.

Each trial, on `pagedserve serve` with a KV pool a little larger than the prefix:
  1. recompute: a prompt of a fresh prefix (--prefix-tokens, never seen) and a short suffix;
  2. two filler prompts fill the pool, so every block of the prefix is evicted to the second tier;
  3. second tier: the same prefix with another suffix: its blocks are restored, not recomputed;
  4. first tier: the same prefix with a third suffix, now cached in the KV pool again.
Each request generates one token, so its latency is its TTFT; one prompt of the prefix's length
warms the server up first. The server's /metrics gives
the second tier's hits (tokens), restored bytes and restore time (pagedserve:kv_offload_*).
The issue's target: second-tier TTFT <= 25% of recompute TTFT. Table + JSON + chart in bench/results.
"""

from __future__ import annotations

import argparse
import random
import re
import sys
import time
from pathlib import Path

import httpx

BLOCK = 16
METRICS = ("kv_offload_hits", "kv_offload_restored_bytes", "kv_offload_restore_seconds", "kv_offload_saved_bytes")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prefix-tokens", type=int, default=4000, help="shared prefix length (default: 4000)")
    p.add_argument("--trials", type=int, default=3, help="trials, each with a fresh prefix (default: 3)")
    p.add_argument("--kv-offload-gb", type=float, default=1.0, help="second tier size (default: 1)")
    p.add_argument("--kv-offload-dir", default=None, help="its directory (default: a temp dir)")
    p.add_argument("--num-threads", type=int, default=None, help="engine CPU threads (default: the engine's)")
    p.add_argument("--dtype", default="auto", help="engine dtype (default: auto)")
    p.add_argument("--kv-cache-dtype", default=None, help="engine --kv-cache-dtype, where the tree has it")
    p.add_argument("--output-dir", default=None, help="where to write JSON and the chart (default: bench/results)")


def _config(args: argparse.Namespace):
    from engine.config import EngineConfig
    num_blocks = -(-(args.prefix_tokens + 2 * BLOCK) // BLOCK) + 16  # the prefix, a suffix, a little room
    extra = {"kv_cache_dtype": args.kv_cache_dtype} if args.kv_cache_dtype else {}
    return EngineConfig(num_kv_blocks=num_blocks, max_model_len=num_blocks * BLOCK, num_threads=args.num_threads,
                        dtype=args.dtype, kv_offload_gb=args.kv_offload_gb, kv_offload_dir=args.kv_offload_dir,
                        **extra)


def scrape(url: str) -> dict[str, float]:
    """The pagedserve:kv_offload_* counters of the HTTP server's /metrics, summed over engines."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return {name: sum(float(v) for v in re.findall(rf"^pagedserve:{name}_total\{{[^}}]*\}} (\S+)$", text, re.M))
            for name in METRICS}


def ttft_s(url: str, prompt: list[int]) -> float:
    """Latency of a one-token completion: its time to first token."""
    start = time.perf_counter()
    r = httpx.post(f"{url}/v1/completions", json={"prompt": prompt, "max_tokens": 1, "temperature": 0}, timeout=600)
    r.raise_for_status()
    return time.perf_counter() - start


def trial(url: str, rng: random.Random, prefix_tokens: int, pool_tokens: int) -> dict:
    words = lambda n: [rng.randrange(1000, 40000) for _ in range(n)]  # noqa: E731 (ids well inside the vocab)
    prefix = words(prefix_tokens)
    out = {"recompute_s": ttft_s(url, prefix + words(8))}
    for _ in range(2):  # each takes over half the pool: together they evict every block of the prefix
        ttft_s(url, words(pool_tokens // 2 + 2 * BLOCK))
    before = scrape(url)
    out["second_tier_s"] = ttft_s(url, prefix + words(8))
    after = scrape(url)
    out.update({name: after[name] - before[name] for name in METRICS})
    out["first_tier_s"] = ttft_s(url, prefix + words(8))
    return out


def run(args: argparse.Namespace) -> int:
    from bench.reporting import RESULTS_DIR, machine_info, median, print_table, write_result
    from bench.servers import server_for
    config = _config(args)
    server = server_for("pagedserve", config, max_concurrent_streams=4)
    server.start()
    try:
        rng = random.Random(0)
        ttft_s(server.http_url, [rng.randrange(1000, 40000) for _ in range(args.prefix_tokens)])  # warm-up
        trials = [trial(server.http_url, rng, args.prefix_tokens, config.num_kv_blocks * BLOCK)
                  for _ in range(args.trials)]
        totals = scrape(server.http_url)
    finally:
        server.stop()
    summary = {key: median([t[key] for t in trials]) for key in trials[0]}
    ratio = summary["second_tier_s"] / summary["recompute_s"]
    print_table(["prefix served by", "TTFT ms (median)", "vs recompute"],
                [[name, 1000 * summary[key], f"{summary[key] / summary['recompute_s']:.1%}"]
                 for name, key in (("recompute", "recompute_s"), ("second tier (restore)", "second_tier_s"),
                                   ("first tier (KV pool)", "first_tier_s"))])
    print(f"restore: {1000 * summary['kv_offload_restore_seconds']:.1f} ms for "
          f"{summary['kv_offload_restored_bytes'] / 2**20:.1f} MiB; /metrics kv_offload_hits per trial: "
          f"{summary['kv_offload_hits']:.0f} of {args.prefix_tokens} prefix tokens; target <= 25%: "
          f"{'met' if ratio <= 0.25 else 'NOT met'} ({ratio:.1%})")
    payload = {"machine": machine_info(config.device), "workload": {
        "model": "bundled", "prefix_tokens": args.prefix_tokens, "trials": args.trials,
        "num_kv_blocks": config.num_kv_blocks, "dtype": config.dtype, "num_threads": config.num_threads,
        "kv_offload_gb": config.kv_offload_gb, "kv_cache_dtype": args.kv_cache_dtype or "auto"},
        "summary": {**summary, "second_tier_vs_recompute": ratio, "target_met": ratio <= 0.25},
        "metrics_totals": totals, "trials": trials}
    path = write_result("kv-offload", payload, Path(args.output_dir) if args.output_dir else RESULTS_DIR)
    print(f"wrote {path}\nchart {_plot(summary, path)}")
    return 0


def _plot(summary: dict, path: Path) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from bench.plots import save_figure
    from bench.reporting import name_plot
    rows = [("recompute", summary["recompute_s"]), ("second tier", summary["second_tier_s"]),
            ("first tier", summary["first_tier_s"])]
    fig, ax = plt.subplots(figsize=(6, 2.4))
    bars = ax.barh([n for n, _ in rows][::-1], [1000 * v for _, v in rows][::-1],
                   color=["tab:gray", "tab:blue", "tab:green"][::-1])
    ax.bar_label(bars, fmt="%.0f ms", padding=3)
    ax.set_xlabel("TTFT of a prompt with a shared prefix, ms (lower is better)")
    ax.set_title("KV offload: a prefix evicted from the KV pool, served from the second tier", fontsize=9)
    ax.margins(x=0.2)
    return name_plot(path, save_figure(fig, path.with_suffix(".png")))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return run(parser.parse_args())


if __name__ == "__main__":
    sys.exit(main())
