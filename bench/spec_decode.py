"""`pagedserve bench spec`: speculative decoding against none, on the same requests.

One `pagedserve serve` per config (`off`, `ngram`, `draft`), started here with the engine flags
and that config's --speculative-method, its engine's /metrics on. Each server runs every
(workload, concurrency) in the same order, each after a warm-up: a closed loop of
--num-prompts requests, at most `concurrency` in flight (see bench.spec_workloads for the
workloads). The engine's acceptance counters are read before and after each timed run (see
bench.spec_metrics).

The gRPC API has no prefix-cache reset, so runs never share prompts instead: random prompts
are drawn per concurrency, and the edit paragraphs are given out in disjoint ranges (cycling
only when more are asked for than exist). Every config's server sees the same sequence, so
caches hold the same at each run.

Prints one table (TPOT speed-up = `off`'s TPOT p50 over the config's) and writes
spec-decode-<stamp>.json with the machine and its CPU flags, and a PNG of TPOT per config.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import signal
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

from bench.load import run_load
from bench.servers import server_for
from bench.spec_metrics import acceptance, run_summary, same_as, scrape_spec_counters, speedup
from bench.spec_workloads import (WORKLOADS, SpecRecord, SpecRequest, edit_requests, generate_spec,
                                  load_edit_tasks, random_spec_requests, shuffled_tasks, warmup_requests)
from engine.arg_utils import add_engine_args, engine_config_from_args
from engine.config import EngineConfig

CONFIGS = ("off", "ngram", "draft")
SET_PER_CONFIG = ("speculative_method", "speculative_model")  # engine flags that --configs decides


@dataclass
class Run:
    """One (workload, concurrency, config) timed run."""

    workload: str
    concurrency: int
    config: str
    records: list[SpecRecord]
    summary: dict
    acceptance: dict | None  # None: the engine exported no speculative counters


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--configs", default="off,ngram", metavar="NAME[,NAME]",
                   help="a server per config, in this order: off (no speculation), ngram (--speculative-method "
                        "ngram, prompt lookup), draft (--speculative-method draft with --draft-model); the "
                        "speed-up is against off, so keep it in the list (default: off,ngram)")
    p.add_argument("--draft-model", default=None, metavar="PATH",
                   help="the draft config's --speculative-model: an HF folder or .gguf sharing the model's "
                        "tokenizer (needed for draft)")
    p.add_argument("--workloads", default=",".join(WORKLOADS), metavar="NAME[,NAME]",
                   help="edit (our paragraphs to repeat with one change, chat, eos honoured: replies copy "
                        "the prompt) and/or random (random token ids, eos ignored) (default: edit,random)")
    p.add_argument("--concurrency", default="1,8", metavar="N[,N]",
                   help="most requests in flight in each run; one run per value (default: 1,8)")
    p.add_argument("--num-prompts", type=int, default=None,
                   help="requests per run (default: 8, or 2 x the concurrency if more)")
    p.add_argument("--edit-output-ratio", type=float, default=1.3,
                   help="edit: max_tokens is this times the paragraph's tokens (default: 1.3)")
    p.add_argument("--random-input-len", type=int, default=128, help="random: prompt tokens (default: 128)")
    p.add_argument("--random-output-len", type=int, default=128, help="random: output tokens (default: 128)")
    p.add_argument("--max-output-len", type=int, default=None,
                   help="a cap on every request's max_tokens, both workloads (default: none)")
    p.add_argument("--seed", type=int, default=0, help="seed for the prompts and their order (default: 0)")
    p.add_argument("--output-dir", type=Path, default=None, help="where to write JSON and PNG (default: bench/results)")
    add_engine_args(p, dtype="auto")
    for action in p._actions:  # set per server by --configs: giving them here would be ignored
        if action.dest in SET_PER_CONFIG:
            action.help = "set per server by --configs (and --draft-model); refused here"


def run(args: argparse.Namespace) -> int:
    from bench.spec_report import report
    configs, workloads, levels = check_args(args)
    base = engine_config_from_args(args)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))  # stop the server too
    runs: list[Run] = []
    requests: dict[tuple[str, int], list[SpecRequest]] = {}
    commands, model = {}, {}
    for name in configs:
        config = config_for(name, base, args.draft_model)
        with _serving(config, name) as (address, command, metrics_url):
            commands[name] = command
            if not requests:  # built on the first server, sent to all
                model, requests = _build_requests(address, workloads, levels, args)
            for (workload, concurrency), batch in requests.items():
                runs.append(_timed_run(address, metrics_url, workload, concurrency, name, batch, model, args))
    # Side by side in the table and the JSON: each (workload, concurrency) with its configs in turn.
    runs.sort(key=lambda r: (workloads.index(r.workload), levels.index(r.concurrency), configs.index(r.config)))
    report(runs, compare(runs), requests, commands, model, base, args)
    return 0 if all(r.summary["failed"] == 0 for r in runs) else 1


def check_args(args: argparse.Namespace) -> tuple[list[str], list[str], list[int]]:
    """(configs, workloads, concurrency levels); SystemExit with what to change."""
    configs = _names("--configs", args.configs, CONFIGS)
    workloads = _names("--workloads", args.workloads, WORKLOADS)
    try:
        levels = [int(c) for c in args.concurrency.split(",") if c.strip()]
    except ValueError:
        levels = []
    if not levels or min(levels) < 1 or len(set(levels)) != len(levels):
        _fail(f"--concurrency: a comma list of distinct positive integers, got {args.concurrency!r}")
    if args.speculative_method is not None or args.speculative_model is not None:
        _fail("--speculative-method and --speculative-model are set per server by --configs (and --draft-model)")
    if ("draft" in configs) != (args.draft_model is not None):
        _fail("the draft config needs --draft-model PATH, and --draft-model needs draft in --configs")
    for flag, value in (("--num-prompts", args.num_prompts), ("--random-input-len", args.random_input_len),
                        ("--random-output-len", args.random_output_len), ("--max-output-len", args.max_output_len)):
        if value is not None and value < 1:
            _fail(f"{flag}: must be at least 1, got {value}")
    if not args.edit_output_ratio > 0:
        _fail(f"--edit-output-ratio: must be > 0, got {args.edit_output_ratio}")
    return configs, workloads, levels


def config_for(name: str, base: EngineConfig, draft_model: str | None) -> EngineConfig:
    """`base` with the config's speculative method (validated by EngineConfig)."""
    method = {"off": None, "ngram": "ngram", "draft": "draft"}[name]
    return replace(base, speculative_method=method, speculative_model=draft_model if name == "draft" else None)


def num_prompts(args: argparse.Namespace, concurrency: int) -> int:
    return args.num_prompts or max(8, 2 * concurrency)


@contextlib.contextmanager
def _serving(config: EngineConfig, name: str) -> Iterator[tuple[str, list[str], str]]:
    """(address, command line, engine /metrics URL) while the config's server runs."""
    server = server_for("pagedserve", config, max_concurrent_streams=256, engine_metrics=True)
    print(f"\n== {name}: starting {' '.join(server.cmd[1:])}", flush=True)
    try:
        address = server.start()
        if server.metrics_url is None:
            raise RuntimeError("pagedserve serve printed no `metrics listening on` line")
        yield address, server.cmd[1:], server.metrics_url
    finally:
        server.stop()


def _build_requests(address: str, workloads: list[str], levels: list[int], args: argparse.Namespace
                    ) -> tuple[dict, dict[tuple[str, int], list[SpecRequest]]]:
    """(GetModelInfo, the requests of each (workload, concurrency)), counted by the server's tokenizer."""
    import grpc

    from bench.serve_workload import grpc_chat_counter, grpc_model_info, grpc_token_counter
    requests = {}
    with grpc.insecure_channel(address) as channel:
        model = grpc_model_info(channel, address)
        count_text = functools.partial(grpc_token_counter(channel), add_special_tokens=False)
        tasks = shuffled_tasks(load_edit_tasks(), args.seed) if "edit" in workloads else []
        start = 0
        for workload in workloads:
            for c in levels:
                n = num_prompts(args, c)
                if workload == "edit":
                    requests[workload, c] = edit_requests(tasks, n, start, args.edit_output_ratio,
                                                          grpc_chat_counter(channel), count_text, args.max_output_len)
                    start += n
                else:
                    out_len = min(args.random_output_len, args.max_output_len or args.random_output_len)
                    requests[workload, c] = random_spec_requests(n, args.random_input_len, out_len,
                                                                 model["vocab_size"], f"{args.seed}:c{c}")
    if "edit" in workloads and start > len(tasks):
        print(f"note: {start} edit prompts asked for, {len(tasks)} exist: later runs repeat some "
              "(a prefix cache serves their prompts again)")
    return model, requests


def _timed_run(address: str, metrics_url: str, workload: str, concurrency: int, config: str,
               requests: list[SpecRequest], model: dict, args: argparse.Namespace) -> Run:
    label = f"{workload} c={concurrency} {config}"
    warmup = warmup_requests(model["vocab_size"], f"{args.seed}:{workload}:c{concurrency}")
    scrapes = []

    async def go() -> tuple[list[SpecRecord], float]:
        import grpc

        from common.v1 import generation_pb2_grpc
        async with grpc.aio.insecure_channel(address) as channel:
            send = functools.partial(generate_spec, generation_pb2_grpc.GenerationStub(channel))
            await asyncio.gather(*(send(r) for r in warmup))
            scrapes.append(scrape_spec_counters(metrics_url))
            return await run_load(send, requests, [0.0] * len(requests), concurrency, desc=label)

    records, duration_s = asyncio.run(go())
    time.sleep(0.2)  # as bench serve: let the engine record the last step before reading
    figures = acceptance(scrapes[0], scrape_spec_counters(metrics_url))
    return Run(workload, concurrency, config, records, run_summary(records, duration_s), figures)


def compare(runs: list[Run]) -> list[dict]:
    """Per run: its speed-up over `off` on the same (workload, concurrency), and how many of
    its replies are token for token `off`'s."""
    off = {(r.workload, r.concurrency): r for r in runs if r.config == "off"}
    out = []
    for r in runs:
        base = off.get((r.workload, r.concurrency))
        out.append({**speedup(r.summary, base.summary if base else None),
                    "same_as_off": same_as(r.records, base.records) if base and r is not base else None})
    return out


def _names(flag: str, text: str, allowed: tuple[str, ...]) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names or set(names) - set(allowed) or len(set(names)) != len(names):
        _fail(f"{flag}: a comma list of distinct names from {', '.join(allowed)}, got {text!r}")
    return names


def _fail(message: str) -> None:
    raise SystemExit(f"bench spec: {message}")

