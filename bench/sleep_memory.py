"""`python -m bench.sleep_memory`: what sleep gives back, on the bundled model with a sizeable KV
cache (--kv-cache-memory-gb, zeroed at start so it is resident).

In one fresh process (the offline `LLM`; the engine process of a server does the same work):
the RSS after load, asleep at level 1 (KV cache freed), awake again, asleep at level 2 (KV cache
and weights freed), awake again; each operation's seconds, and whether greedy output after each
wake equals the output before the first sleep. Prints a table and writes JSON with the machine
to bench/results/.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

PROMPTS = ["The capital of France is", "Once upon a time, in a small village,"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--kv-cache-memory-gb", type=float, default=2.0, help="the KV cache's size (default: 2)")
    p.add_argument("--dtype", default="bfloat16", help="the engine's dtype (default: bfloat16)")
    p.add_argument("--max-tokens", type=int, default=16, help="greedy tokens per prompt checked (default: 16)")
    p.add_argument("--output-dir", default=None, help="where to write JSON (default: bench/results)")


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


def measure(args: argparse.Namespace) -> tuple[list[dict], dict]:
    """One row per state: its RSS, the operation that reached it and its seconds, and whether
    greedy output after it matched the first."""
    from engine.models.source import bundled_model_path
    from pagedserve import LLM, SamplingParams
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    before_load = rss_mib()
    start = time.perf_counter()
    llm = LLM(str(bundled_model_path()), dtype=args.dtype, kv_cache_memory_gb=args.kv_cache_memory_gb)
    rows = [{"state": "awake (loaded)", "operation": "load", "seconds": time.perf_counter() - start}]

    def generate() -> list[list[int]]:
        return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]

    first = generate()
    rows[0].update(rss_mib=rss_mib(), same_output=True)
    for state, operation, call in (("asleep, level 1", "sleep(1)", lambda: llm.sleep(1)),
                                   ("awake", "wake_up", llm.wake_up),
                                   ("asleep, level 2", "sleep(2)", lambda: llm.sleep(2)),
                                   ("awake", "wake_up", llm.wake_up)):
        start = time.perf_counter()
        call()
        row = {"state": state, "operation": operation, "seconds": time.perf_counter() - start, "rss_mib": rss_mib()}
        if state == "awake":
            row["same_output"] = generate() == first
        rows.append(row)
    runner = llm.engine.model_runner
    workload = {"model": "bundled", "dtype": args.dtype, "kv_cache_memory_gb": args.kv_cache_memory_gb,
                "num_kv_blocks": runner.num_kv_blocks, "rss_before_load_mib": before_load,
                "prompts": PROMPTS, "max_tokens": args.max_tokens}
    return rows, workload


def run(args: argparse.Namespace) -> int:
    from bench.reporting import RESULTS_DIR, machine_info, print_table, write_result
    rows, workload = measure(args)
    awake = rows[0]["rss_mib"]
    for row in rows:
        row["freed_mib"] = awake - row["rss_mib"]
    print_table(["state", "after", "s", "RSS MiB", "freed MiB", "same greedy output"],
                [[r["state"], r["operation"], r["seconds"], r["rss_mib"], r["freed_mib"], r.get("same_output", "")]
                 for r in rows])
    path = write_result("sleep-memory", {"machine": machine_info(), "workload": workload, "results": rows},
                        Path(args.output_dir) if args.output_dir else RESULTS_DIR)
    print(f"wrote {path}")
    return 0 if all(r.get("same_output", True) for r in rows) else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return run(parser.parse_args())


if __name__ == "__main__":
    sys.exit(main())
