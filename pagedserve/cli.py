"""The `pagedserve` command: one entry point, a subcommand per tool."""

from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pagedserve", description="pagedserve: an LLM serving engine with a paged KV cache.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    bench = commands.add_parser("bench", help="benchmarks", description="Benchmarks.")
    bench_kinds = bench.add_subparsers(dest="bench", required=True, metavar="BENCH")
    from bench.offline import add_arguments as add_offline
    add_offline(bench_kinds.add_parser(
        "offline", help="offline throughput of the engine (optionally against HF transformers)",
        description="Offline throughput: the engine in-process on a fixed workload, "
                    "optionally against HF transformers generate on the same prompts."))
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "bench" and args.bench == "offline":
        from bench.offline import run
        return run(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
