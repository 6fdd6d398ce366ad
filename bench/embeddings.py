"""`pagedserve bench embeddings` (or `python -m bench.embeddings`): /v1/embeddings of
`pagedserve serve` against sentence-transformers' `encode`, in one run on one machine.

Workload: --num-texts (2,000) texts of our own prose, their lengths uniform in [--min-len,
--max-len] (8-256) tokens of the model's tokenizer, special tokens included
(bench.datasets.sized_texts, --seed). The model is all-MiniLM-L6-v2 unless --model names
another sentence-transformers folder. Measured one after the other, never two at once:

  - the peer: `SentenceTransformer(folder, device="cpu").encode(texts, batch_size=B)` at each
    --st-batch-sizes, in each --st-dtypes (float32 is its default; bfloat16 loads it with
    model_kwargs torch_dtype); the best float32 batch size is the baseline.
  - offline: pagedserve's `LLM(model).embed(texts)` in this process (--no-offline skips it).
  - the server: `pagedserve serve` with the engine flags given, over its HTTP API, through
    bench serve's load generator (bench.load) and /v1/embeddings client (bench.serve_embeddings):
    throughput, the texts in requests of --texts-per-request from --clients clients at once;
    latency, --latency-requests requests of one text each from --latency-clients at once.

Every vector pagedserve returns is compared with the peer's float32 one (cosine). Prints a
table and each row's ratio to the baseline (the target: pagedserve's server at 2x its texts/s);
writes embeddings-*.json, with the machine and its load, and a PNG.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import os
import signal
import sys
import time
from collections.abc import Iterator

import numpy as np

from bench.datasets import BenchRequest, embedding_requests, sized_texts
from bench.load import run_load
from bench.reporting import OtherLoad, machine_info, print_table, write_result
from bench.serve_embeddings import DEFAULT_MODEL, embed, summary_extras
from bench.serve_metrics import latency_stats, summarize
from engine.arg_utils import add_engine_args, engine_config_from_args
from engine.config import EngineConfig

ST_DTYPES = ("float32", "bfloat16")
NUM_WARMUP_TEXTS = 64


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--num-texts", type=int, default=2000, help="texts in the workload (default: 2000)")
    p.add_argument("--min-len", type=int, default=8, help="shortest text in tokens, special ones included (default: 8)")
    p.add_argument("--max-len", type=int, default=256, help="longest text in tokens (default: 256, the model's limit)")
    p.add_argument("--seed", type=int, default=0, help="seed of the texts (default: 0)")
    p.add_argument("--st-batch-sizes", type=_int_list, default=[16, 32, 64, 128], metavar="B,B,...",
                   help="sentence-transformers encode batch sizes (default: 16,32,64,128)")
    p.add_argument("--st-dtypes", type=_dtype_list, default=list(ST_DTYPES), metavar="DTYPE,...",
                   help="sentence-transformers dtypes, each at every batch size; float32 is its default and "
                        "the baseline (default: float32,bfloat16)")
    p.add_argument("--texts-per-request", type=int, default=64,
                   help="server throughput: texts per /v1/embeddings request (default: 64)")
    p.add_argument("--clients", type=int, default=8, help="server throughput: requests in flight (default: 8)")
    p.add_argument("--latency-requests", type=int, default=1000,
                   help="server latency: requests of one text each (default: 1000)")
    p.add_argument("--latency-clients", type=int, default=32, help="server latency: requests in flight (default: 32)")
    p.add_argument("--offline", action=argparse.BooleanOptionalAction, default=True,
                   help="also time pagedserve's LLM.embed in this process (default: on)")
    p.add_argument("--output-dir", default=None, help="where to write JSON and PNG (default: bench/results)")
    add_engine_args(p, dtype="auto")
    p.set_defaults(model=DEFAULT_MODEL)
    for action in p._actions:
        if action.dest == "model":
            action.help = f"a sentence-transformers model folder, or {DEFAULT_MODEL} (default: {DEFAULT_MODEL})"


def _int_list(text: str) -> list[int]:
    try:
        values = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"a comma list of positive integers, got {text!r}")
    return values


def _dtype_list(text: str) -> list[str]:
    dtypes = [d.strip() for d in text.split(",") if d.strip()]
    if not dtypes or set(dtypes) - set(ST_DTYPES):
        raise argparse.ArgumentTypeError(f"a comma list of {', '.join(ST_DTYPES)}, got {text!r}")
    return dtypes


def run(args: argparse.Namespace) -> int:
    from engine.models.loader import load_tokenizer
    from engine.models.source import model_files
    for flag in ("num_texts", "texts_per_request", "clients", "latency_requests", "latency_clients", "min_len"):
        if getattr(args, flag) < 1:
            raise SystemExit(f"bench embeddings: --{flag.replace('_', '-')} must be at least 1")
    config = engine_config_from_args(args)
    folder = model_files(config)
    tokenizer = load_tokenizer(folder)
    count = lambda text, special: len(tokenizer.encode(text, add_special_tokens=special))  # noqa: E731
    try:
        texts = sized_texts(count, args.num_texts, args.min_len, args.max_len, args.seed)
        warmup = sized_texts(count, NUM_WARMUP_TEXTS, args.min_len, args.max_len, f"{args.seed}:warmup")
    except ValueError as e:
        raise SystemExit(f"bench embeddings: {e}") from e
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))  # stop the server too
    loadavg_before = os.getloadavg()  # the machine may be shared: say how busy it was
    results, vectors = _time_st(folder, texts, warmup, args)
    if args.offline:
        results.update(_time_offline(config, texts, warmup, vectors))
    results.update(_time_server(config, texts, warmup, vectors, args))
    _report(results, texts, config, folder, loadavg_before, args)
    return 0 if all(r.get("failed", 0) == 0 for r in results.values()) else 1


def _time_st(folder, texts: list[tuple[str, int]], warmup: list[tuple[str, int]], args) -> tuple[dict, np.ndarray]:
    """Each (dtype, batch size)'s texts/s, and the float32 vectors (the reference)."""
    import torch
    from sentence_transformers import SentenceTransformer
    plain = [t for t, _ in texts]
    tokens = sum(n for _, n in texts)
    results, reference = {}, None
    for dtype in args.st_dtypes:
        kwargs = {} if dtype == "float32" else {"model_kwargs": {"torch_dtype": getattr(torch, dtype)}}
        model = SentenceTransformer(str(folder), device="cpu", **kwargs)
        model.encode([t for t, _ in warmup], batch_size=32)
        for batch_size in args.st_batch_sizes:
            print(f"sentence-transformers {dtype}, batch size {batch_size}", flush=True)
            others, start = OtherLoad(), time.perf_counter()
            out = model.encode(plain, batch_size=batch_size, show_progress_bar=sys.stderr.isatty(),
                               convert_to_numpy=True)
            seconds = time.perf_counter() - start
            results[f"st_{dtype}_bs{batch_size}"] = {
                "kind": "sentence-transformers", "dtype": dtype, "batch_size": batch_size, "seconds": seconds,
                "texts_per_s": len(texts) / seconds, "tok_s": tokens / seconds, "threads": torch.get_num_threads(),
                "other_cores": others.cores()}
            if dtype == "float32":
                reference = out.astype(np.float32) if reference is None else reference
            elif reference is not None:
                results[f"st_{dtype}_bs{batch_size}"]["cosine"] = _cosines(reference, out)
        del model
        gc.collect()
    if reference is None:
        reference = SentenceTransformer(str(folder), device="cpu").encode(plain, batch_size=32)
    return results, reference


def _time_offline(config: EngineConfig, texts, warmup, reference: np.ndarray) -> dict:
    """pagedserve's LLM.embed in this process, freed before the server starts."""
    from pagedserve import LLM
    if not hasattr(LLM, "embed"):
        print("offline: this pagedserve has no LLM.embed; skipped", flush=True)
        return {}
    llm = LLM(**vars(config))
    llm.embed([t for t, _ in warmup])
    print("pagedserve offline, LLM.embed", flush=True)
    others, start = OtherLoad(), time.perf_counter()
    outs = llm.embed([t for t, _ in texts], use_tqdm=sys.stderr.isatty())
    seconds = time.perf_counter() - start
    dtype = llm.config.dtype
    del llm
    gc.collect()
    return {"offline": {"kind": "pagedserve LLM.embed", "dtype": dtype, "seconds": seconds,
                        "texts_per_s": len(texts) / seconds, "tok_s": sum(n for _, n in texts) / seconds,
                        "other_cores": others.cores(),
                        "cosine": _cosines(reference, np.array([o.embedding for o in outs], dtype=np.float32))}}


def _time_server(config: EngineConfig, texts, warmup, reference: np.ndarray, args) -> dict:
    from bench.openai_client import served_model
    from bench.servers import server_cpu_s
    requests = embedding_requests(texts, args.texts_per_request)
    first = {id(r): k * args.texts_per_request for k, r in enumerate(requests)}  # its first text's index
    got = np.zeros_like(reference)

    def keep(request: BenchRequest, vectors: list[list[float]]) -> None:
        got[first[id(request)]:first[id(request)] + len(vectors)] = vectors

    with _serving(config) as (url, grpc_address, command, pid):
        dtype, (model, _) = _served_dtype(grpc_address), served_model(url, None, None)
        print(f"pagedserve serve is up: {url}, {model} in {dtype}", flush=True)
        asyncio.run(_load(url, model, embedding_requests(warmup, args.texts_per_request), 2, "warm-up"))
        cpu_before = server_cpu_s(pid)
        throughput = asyncio.run(_load(url, model, requests, args.clients,
                                       f"server, {args.texts_per_request} texts a request", keep))
        throughput.update(_cpu(cpu_before, server_cpu_s(pid), len(texts)))
        single = embedding_requests([texts[i % len(texts)] for i in range(args.latency_requests)], 1)
        latency = asyncio.run(_load(url, model, single, args.latency_clients, "server, one text a request"))
    done = throughput["completed"] == throughput["num_requests"]
    server = {"kind": "pagedserve serve /v1/embeddings", "dtype": dtype, "command": command,
              "texts_per_request": args.texts_per_request, "clients": args.clients, **throughput,
              "cosine": _cosines(reference, got) if done else None}
    return {"server": server, "server_latency": {"kind": "pagedserve serve /v1/embeddings, one text a request",
                                                 "dtype": dtype, "clients": args.latency_clients, **latency}}


@contextlib.contextmanager
def _serving(config: EngineConfig) -> Iterator[tuple[str, str, list[str], int]]:
    """(its OpenAI base URL, its gRPC address, its command line, its pid) while it runs."""
    from bench.servers import server_for
    server = server_for("pagedserve", config, max_concurrent_streams=256)
    print(f"starting {' '.join(server.cmd[1:])}", flush=True)
    try:
        address = server.start()  # once the engine is ready
        yield f"{server.http_url}/v1", address, server.cmd[1:], server.proc.pid
    finally:
        server.stop()


def _served_dtype(address: str) -> str:
    import grpc

    from bench.serve_workload import grpc_model_info
    with grpc.insecure_channel(address) as channel:
        return grpc_model_info(channel, address)["dtype"]


async def _load(url: str, model: str, requests: list, clients: int, desc: str, on_vectors=None) -> dict:
    """bench serve's load generator, every request at once and `clients` in flight: the
    summary (E2E latencies, texts/s, prompt tok/s) and the client's CPU seconds."""
    import functools

    from bench.openai_client import open_client
    async with open_client(url, None, keep_alive=True) as client:
        send = functools.partial(embed, client, model, on_vectors=on_vectors)
        cpu, others = time.process_time(), OtherLoad()
        records, duration_s = await run_load(send, requests, [0.0] * len(requests), clients, desc=desc)
        cpu = time.process_time() - cpu
    summary = summarize(records, duration_s)
    keep = ("completed", "failed", "errors", "duration_s", "request_throughput", "prompt_tokens")
    return {"num_requests": len(requests), **{k: summary[k] for k in keep},
            **latency_stats("e2e_ms", [r.e2e_s * 1000 for r in records if r.ok]),
            **summary_extras(records, requests, duration_s), "client_cpu_s": cpu,
            "other_cores": others.cores()}


def _cpu(before: dict | None, after: dict | None, num_texts: int) -> dict:
    """The server's CPU ms per text over the run, by process (the frontend's JSON work shows here)."""
    if before is None or after is None:
        return {}
    return {f"{name}_cpu_ms_per_text": 1e3 * (after[name] - before[name]) / num_texts for name in before}


def _cosines(reference: np.ndarray, other) -> dict:
    a = np.asarray(reference, dtype=np.float64)
    b = np.asarray(other, dtype=np.float64)
    cos = (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))
    return {"min": float(cos.min()), "mean": float(cos.mean())}


def _report(results: dict, texts, config: EngineConfig, folder, loadavg_before, args) -> None:
    from bench.plots import plot_embeddings
    st = {k: r for k, r in results.items() if k.startswith("st_float32")}
    best = max(st, key=lambda k: st[k]["texts_per_s"]) if st else None
    base = results[best]["texts_per_s"] if best else None
    ratios = {f"{k}_vs_{best}": r["texts_per_s"] / base for k, r in results.items()
              if best and k in ("server", "offline", *(n for n in results if n.startswith("st_bfloat16")))}
    rows = [[name, r["dtype"], r.get("batch_size", r.get("texts_per_request", "")), r.get("clients", ""),
             r["texts_per_s"], r.get("tok_s", r.get("prompt_tok_s")), r.get("seconds", r.get("duration_s")),
             f"{r['texts_per_s'] / base:.2f}x" if base else "n/a",
             f"{r['cosine']['min']:.5f}" if r.get("cosine") else "", _cores(r.get("other_cores"))]
            for name, r in results.items() if name != "server_latency"]
    print()
    print_table(["run", "dtype", "batch", "clients", "texts/s", "tok/s", "seconds", f"vs {best}", "min cosine",
                 "others"], rows)
    print("(others: CPU cores other processes took meanwhile, on average; more than ~0.1 skews the run)")
    lat = results.get("server_latency")
    if lat:
        print(f"\nserver, one text a request, {lat['clients']} clients: {lat['texts_per_s']:.1f} texts/s, "
              f"E2E p50 {lat['median_e2e_ms']:.1f} ms, p90 {lat['p90_e2e_ms']:.1f} ms, p99 {lat['p99_e2e_ms']:.1f} ms "
              f"({lat['completed']} ok, {lat['failed']} failed; others {_cores(lat.get('other_cores'))})")
    for name, ratio in ratios.items():
        print(f"{name}: {ratio:.2f}x texts/s")
    machine = machine_info(config.device)
    lengths = [n for _, n in texts]
    payload = {"machine": machine, "loadavg_before": loadavg_before, "loadavg_after": os.getloadavg(),
               "model": {"name": config.model, "path": str(folder)}, "engine_config": vars(config),
               "workload": {"num_texts": len(texts), "min_len": args.min_len, "max_len": args.max_len,
                            "seed": args.seed, "mean_len": float(np.mean(lengths)), "tokens": sum(lengths),
                            "texts_per_request": args.texts_per_request, "clients": args.clients,
                            "latency_requests": args.latency_requests, "latency_clients": args.latency_clients},
               "results": results, "baseline": best, "ratios": ratios}
    path = write_result("embeddings", payload, args.output_dir)
    title = (f"{os.path.basename(str(folder))}: {len(texts)} texts of {args.min_len}-{args.max_len} tokens "
             f"(mean {np.mean(lengths):.0f})\n{machine['cpu']}, {machine['num_cpus']} CPUs, "
             f"load {loadavg_before[0]:.1f} before")
    chart = plot_embeddings(results, title, path.with_suffix(".png"))
    print(f"\nwrote {path} and {chart.name}")


def _cores(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.embeddings", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
