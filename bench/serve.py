"""`pagedserve bench serve`: latency and throughput of a server under load, over gRPC or
over the OpenAI API.

Without --target it starts the server itself on the bundled model (or --model, or
--random-weights SHAPE: see bench.random_model), one backend at a time so that two never
share cores: `pagedserve` (`pagedserve serve` with the engine flags given) or `hf`
(bench.hf_server: HF transformers generate, one request at a time).
`--backend openai --target http://HOST:PORT/v1` drives a running OpenAI-compatible server
instead (pagedserve's HTTP API, vLLM, llama-server: see bench.openai_client).
Each run sends --num-prompts requests of a dataset (see bench.datasets) on an arrival
schedule (see bench.load), greedy with eos ignored so that every request produces exactly
its planned output length, and reports what bench.serve_metrics computes. --sweep-rates
repeats the run per rate and draws the throughput-latency curves. Every run writes one JSON
under --output-dir; a sweep adds a summary JSON and a PNG.

Each run gets fresh prompts (synthetic datasets are drawn again per rate), so the prefix
cache never serves one run's prompts to the next. ShareGPT prompts are fixed text: in a
ShareGPT sweep a server started here is restarted between rates for the same reason.

`--dataset-name structured` asks for JSON instead (see bench.serve_structured): requests end on
their own, the report splits by constrained and unconstrained requests, and --structured-ratio
0,0.5,1 runs the same prompts at each constrained share, on a fresh server each (no prefix or
grammar cache carried over), then prints and writes one summary of them all.

`--dataset-name embeddings` posts texts to /v1/embeddings of an embedding model instead (see
bench.serve_embeddings): the report gives texts/s, prompt tok/s and E2E latency.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import os
import signal
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from bench import serve_embeddings
from bench.random_model import use_random_weights
from bench.reporting import machine_info, name_plot, write_result
from bench.serve_args import ServePlan, add_arguments, check_args
from bench.serve_metrics import rate_label, summarize
from bench.serve_report import (print_run, print_runs, print_structured, print_structured_runs,
                                structured_summary, sweep_payload)
from bench.serve_structured import group_summaries, scrape_step_seconds, step_phases
from bench.serve_workload import build_workload, drive, time_offline
from bench.servers import cpu_ms_per_token, server_cpu_s, server_for
from engine.arg_utils import engine_config_from_args
from engine.config import EngineConfig

__all__ = ["add_arguments", "run"]


@dataclass
class RunResult:
    """One (backend, rate) run: where its JSON went and what it measured."""

    backend: str  # or the --label that names it
    rate: float
    path: Path
    summary: dict
    model: dict  # GetModelInfo of the server it ran on (OpenAI: the same keys, see bench.openai_client)
    dataset: dict
    structured: dict | None  # the structured dataset's groups and step phases


@dataclass
class _Bench:
    """What every run of this invocation shares."""

    args: argparse.Namespace
    plan: ServePlan
    config: EngineConfig
    offline: dict | None  # --compare-offline's numbers


def run(args: argparse.Namespace) -> int:
    plan = check_args(args)
    use_random_weights(args, "bench serve")  # the servers started here, hf too, and openai's local files
    config = engine_config_from_args(args)
    offline = time_offline(config, args) if args.compare_offline else None
    bench = _Bench(args, plan, config, offline)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))  # stop the servers too
    results: list[RunResult] = []
    runs = list(enumerate(plan.runs()))
    for backend in plan.backends:
        # ShareGPT's and the structured prompts never change: on our own server, one per run.
        fresh = not args.target and plan.dataset in ("sharegpt", "structured") and len(runs) > 1
        for group in [[run] for run in runs] if fresh else [runs]:
            with _serving(backend, bench) as (address, command, metrics_url, pid):
                results += [_one_run(address, command, metrics_url, backend, i, rate, ratio, bench, pid)
                            for i, (rate, ratio) in group]
    if plan.dataset == "structured" and len(results) > 1:
        _write_structured(results, bench)
    elif len(results) > 1:
        _write_sweep(results, bench)
    failed = sum(r.summary["failed"] for r in results)
    return 0 if not failed else 1


@contextlib.contextmanager
def _serving(backend: str, bench: _Bench) -> Iterator[tuple[str, list[str] | None, str | None, int | None]]:
    """(address, the server's command line or None with --target, its engine's /metrics URL
    or None, its process id or None with --target) while the server runs."""
    if bench.args.target:  # always so with --backend openai: this benchmark starts no such server
        yield bench.args.target, None, bench.args.metrics_url, None
        return
    # Streams beyond the frontend's cap would fail as RESOURCE_EXHAUSTED: the benchmark's
    # own concurrency limit is the one that should bind.
    server = server_for(backend, bench.config, max_concurrent_streams=max(256, bench.args.num_prompts),
                        engine_metrics=bench.plan.dataset == "structured")
    print(f"starting {backend} ...", flush=True)
    try:
        address = server.start()
        if bench.plan.dataset == "embeddings":  # over its OpenAI API
            address = f"{server.http_url}/v1"
        yield address, server.cmd[1:], server.metrics_url, server.proc.pid
    finally:
        server.stop()


def _one_run(address: str, command: list[str] | None, metrics_url: str | None, backend: str, index: int,
             rate: float, ratio: float | None, bench: _Bench, pid: int | None = None) -> RunResult:
    args = bench.args
    name = args.label or backend
    label = f"{name} @ {rate_label(rate)} req/s" + ("" if ratio is None else f", {ratio:g} constrained")
    workload = build_workload(address, args, bench.plan, index, backend, ratio)
    scrapes = []  # the engine's step times just before the timed run
    before = None
    if ratio is not None and metrics_url:
        before = lambda: scrapes.append(scrape_step_seconds(metrics_url))  # noqa: E731
    cpu_before = server_cpu_s(pid)
    records, duration_s = asyncio.run(drive(address, workload, rate, args, index, label, backend, before))
    summary = summarize(records, duration_s, bench.plan.slos)
    if bench.plan.dataset == "embeddings":
        summary.update(serve_embeddings.summary_extras(records, workload.requests, duration_s))
    summary.update(cpu_ms_per_token(cpu_before, server_cpu_s(pid), summary["output_tokens"]))
    ratios = _offline_ratios(summary, bench.offline)
    print_run(label, summary, bench.offline, ratios)
    structured = (None if ratio is None else
                  _structured(ratio, records, duration_s, summary, scrapes, metrics_url, bench))
    offline = {"offline": bench.offline} if bench.offline else {}
    api = "openai" if backend == "openai" or bench.plan.dataset == "embeddings" else "grpc"
    payload = {
        "machine": machine_info(bench.config.device), "backend": backend, "label": name, "api": api,
        "target": args.target,
        "server_command": command, "model": workload.model,
        "engine_config": vars(bench.config) if command and backend == "pagedserve" else None,
        "dataset": workload.dataset, "request_rate": rate_label(rate), "burstiness": args.burstiness,
        "max_concurrency": args.max_concurrency, "run_index": index,
        "args": {k: _jsonable(v) for k, v in vars(args).items() if k not in ("command", "bench", "api_key")},
        "results": {api: summary, **offline}, "ratios": ratios,
        **({"structured": structured} if structured else {}),
        "requests": [_record_json(r) for r in records],
    }
    suffix = f"-{name}-rate{rate_label(rate)}" + ("" if ratio is None else f"-structured{ratio:g}")
    path = write_result("serve", payload, args.output_dir, suffix=suffix)
    print(f"wrote {path}\n")
    return RunResult(name, rate, path, summary, workload.model, workload.dataset, structured)


def _structured(ratio: float, records: list, duration_s: float, summary: dict, scrapes: list,
                metrics_url: str | None, bench: _Bench) -> dict:
    """The structured dataset's split by group, and the engine's step phases over the timed run."""
    phases = None
    if scrapes:
        time.sleep(0.2)  # the engine records a step's times just after it sends the step's outputs
        phases = step_phases(scrapes[0], scrape_step_seconds(metrics_url))
    groups = group_summaries(records, duration_s, bench.plan.slos)
    whole = structured_summary(summary, groups)
    print_structured(whole, groups, phases)
    # Other work on this machine's few cores would slow every group: say how busy it was.
    return {"structured_ratio": ratio, "all": whole, "groups": groups, "step_phases": phases,
            "metrics_url": metrics_url, "load_avg_1m_after": os.getloadavg()[0]}


def _write_structured(results: list[RunResult], bench: _Bench) -> None:
    """One table and one JSON for the runs at each constrained share (or rate)."""
    runs = [{"backend": r.backend, "request_rate": rate_label(r.rate), "file": r.path.name, **r.structured}
            for r in results]
    print_structured_runs(runs)
    payload = {"machine": machine_info(bench.config.device), "model": results[-1].model,
               "dataset": {k: v for k, v in results[-1].dataset.items() if k not in ("structured_ratio",
                                                                                     "num_constrained")},
               "max_concurrency": bench.args.max_concurrency, "burstiness": bench.args.burstiness,
               "target": bench.args.target, "seed": bench.args.seed, "runs": runs}
    path = write_result("serve-structured", payload, bench.args.output_dir)
    print(f"\nwrote {path}")


def _offline_ratios(summary: dict, offline: dict | None) -> dict:
    if not offline:
        return {}
    return {"grpc_vs_offline_output_tok_s": summary["output_tok_s"] / offline["output_tok_s"],
            "grpc_vs_offline_all_at_once_output_tok_s":
                summary["output_tok_s"] / offline["all_at_once"]["output_tok_s"]}


def _write_sweep(results: list[RunResult], bench: _Bench) -> None:
    from bench.plots import plot_sweep
    machine, model, dataset = machine_info(bench.config.device), results[-1].model, results[-1].dataset
    runs = [{"backend": r.backend, "request_rate": rate_label(r.rate), "file": r.path.name, **r.summary}
            for r in results]
    print_runs(runs)
    path = write_result("serve-sweep", sweep_payload(runs, machine, model, dataset, bench.plan, bench.args),
                        bench.args.output_dir)
    title = (f"{model['model_name']} ({model['dtype']}), {dataset['name']}: {dataset['num_prompts']} requests per "
             f"run, mean {dataset['mean_prompt_len']:.0f} in / {dataset['mean_output_len']:.0f} out tokens, "
             f"burstiness {bench.args.burstiness:g}\n{machine['cpu']}, {machine['num_cpus']} CPUs")
    chart = plot_sweep(runs, title, path.with_suffix(".png"))
    name_plot(path, chart)
    print(f"\nwrote {path} and {chart.name}")


def _record_json(record) -> dict:
    from dataclasses import asdict
    out = asdict(record)
    out["token_times_s"] = [round(t, 5) for t in record.token_times_s]  # 10 us is plenty; keeps files small
    out["num_output_tokens"] = record.num_output_tokens
    return {k: _jsonable(v) for k, v in out.items()}


def _jsonable(value):
    """JSON has no inf, nan or paths: write them as strings."""
    if isinstance(value, float) and not math.isfinite(value) or isinstance(value, Path):
        return str(value)
    if isinstance(value, list):
        return [_jsonable(v) for v in value]
    return value
