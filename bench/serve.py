"""`pagedserve bench serve`: latency and throughput of a pagedserve server over gRPC.

Workload as in `bench offline` (defaults): 64 prompts of 128 random token ids, 128 output
tokens each, greedy, eos ignored; at most --max-concurrency Generate streams in flight.
Without --target the benchmark starts its own `pagedserve serve` with the engine flags it
was given and stops it at the end. Per request it records TTFT, the arrival time of every
token (a Chunk may carry several: they share its arrival time), E2E latency and the gRPC
status. With --compare-offline it first times `engine.LLM` in this process on the same
prompts, so the cost of the serving path shows as a ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import gc
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field, fields, replace

import numpy as np
from tqdm import tqdm

from bench.common import machine_info, print_table, write_result
from bench.offline import random_prompts
from engine.arg_utils import add_engine_args, engine_config_from_args
from engine.config import EngineConfig

GENERATION_SERVICE = "pagedserve.v1.Generation"
SERVER_START_TIMEOUT_S = 300
SERVER_STOP_TIMEOUT_S = 30


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default=None, metavar="HOST:PORT",
                   help="a running pagedserve frontend (default: start one here with the engine "
                        "flags below, and stop it at the end; with --target those flags are ignored)")
    p.add_argument("--num-prompts", type=int, default=64, help="prompts in the workload (default: 64)")
    p.add_argument("--input-len", type=int, default=128, help="prompt tokens (default: 128)")
    p.add_argument("--output-len", type=int, default=128, help="output tokens per prompt (default: 128)")
    p.add_argument("--max-concurrency", type=int, default=32,
                   help="Generate streams in flight at once (default: 32)")
    p.add_argument("--seed", type=int, default=0, help="seed for the random prompts (default: 0)")
    p.add_argument("--compare-offline", action="store_true",
                   help="also time engine.LLM in this process on the same prompts, before the server "
                        "starts, and report grpc / offline output throughput; only valid without "
                        "--target (both must run on the same machine)")
    p.add_argument("--output-dir", default=None, help="where to write JSON (default: bench/results)")
    add_engine_args(p, dtype="bfloat16")


@dataclass(slots=True)
class RequestRecord:
    """One Generate stream, timed on this side of the wire (seconds since its send)."""

    prompt_tokens: int
    ok: bool = False
    code: str = "OK"  # the gRPC status code's name
    error: str = ""
    ttft_s: float = float("nan")  # to the first Chunk with tokens
    e2e_s: float = float("nan")
    cached_tokens: int = 0  # prompt tokens the server's prefix cache served
    token_times_s: list[float] = field(default_factory=list)  # one per output token

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_times_s)


def run(args: argparse.Namespace) -> int:
    if args.compare_offline and args.target:
        raise SystemExit("--compare-offline needs the server on this machine: drop --target")
    config = engine_config_from_args(args)
    offline = _time_offline(config, args) if args.compare_offline else None
    server = None if args.target else ServerProcess(config)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))  # stop the server too
    try:
        address = args.target or server.start()
        records, duration_s, model = asyncio.run(_run_grpc(address, args))
    finally:
        if server:
            server.stop()
    summary = summarize(records, duration_s)
    ratio = summary["output_tok_s"] / offline["output_tok_s"] if offline else None
    ratios = {} if ratio is None else {
        "grpc_vs_offline_output_tok_s": ratio,
        "grpc_vs_offline_all_at_once_output_tok_s": summary["output_tok_s"] / offline["all_at_once"]["output_tok_s"]}
    _report(summary, offline, ratios)
    path = write_result("serve", {
        "machine": machine_info(config.device), "target": args.target, "model": model,
        "engine_config": None if args.target else vars(config),
        "args": {k: v for k, v in vars(args).items() if k not in ("command", "bench")},
        "results": {"grpc": summary, **({"offline": offline} if offline else {})},
        "ratios": ratios,
        "requests": [{**asdict(r), "num_output_tokens": r.num_output_tokens} for r in records],
    }, args.output_dir)
    print(f"\nwrote {path}")
    return 0 if not summary["failed"] else 1


def _time_offline(config: EngineConfig, args: argparse.Namespace) -> dict:
    """engine.LLM on the same prompts, freed before the server starts: they never share cores.
    Twice: capped at --max-concurrency sequences like the gRPC run (what serving costs on top
    of the engine), and with every prompt at once (the engine's own best)."""
    same = _time_offline_once(replace(config, max_num_seqs=min(config.max_num_seqs, args.max_concurrency)), args)
    return {**same, "all_at_once": _time_offline_once(config, args)}


def _time_offline_once(config: EngineConfig, args: argparse.Namespace) -> dict:
    from engine import LLM, SamplingParams
    llm = LLM(**vars(config))
    prompts = random_prompts(args.num_prompts, args.input_len, llm.engine.vocab_size, args.seed)
    warmup = random_prompts(2, args.input_len, llm.engine.vocab_size, args.seed + 1)
    llm.generate(warmup, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    llm.reset_prefix_cache()
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=True)
    seconds = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    del llm, outs
    gc.collect()
    return {"output_tokens": tokens, "seconds": seconds, "output_tok_s": tokens / seconds,
            "total_tok_s": (tokens + len(prompts) * args.input_len) / seconds,
            "max_num_seqs": config.max_num_seqs}


class ServerProcess:
    """`pagedserve serve` as a child: started on a free port, drained, stopped with SIGTERM."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.proc: subprocess.Popen | None = None
        self.tail: collections.deque[str] = collections.deque(maxlen=40)
        self.address: str | None = None
        self.listening = threading.Event()
        # `serve` keeps its frontend up when the engine child dies: spot the traceback instead.
        self.crashed = False

    def start(self) -> str:
        engine_address = f"tcp://127.0.0.1:{_free_port()}"
        cmd = [sys.executable, "-m", "pagedserve", "serve", "--grpc-port", "0",
               "--engine-address", engine_address, *engine_flags(self.config)]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        # Drain its output for the whole run: a full pipe would block the server.
        threading.Thread(target=self._drain, daemon=True).start()
        deadline = time.monotonic() + SERVER_START_TIMEOUT_S
        if not self.listening.wait(SERVER_START_TIMEOUT_S) or self.address is None:
            self._fail("never printed `grpc listening on`")
        self._wait_serving(deadline)
        return self.address

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(SERVER_STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            print(f"server did not stop in {SERVER_STOP_TIMEOUT_S}s; killing it", file=sys.stderr)
            self.proc.kill()
            self.proc.wait()

    def _drain(self) -> None:
        for line in self.proc.stdout:
            self.tail.append(line)
            self.crashed = self.crashed or line.startswith("Traceback")
            match = not self.listening.is_set() and re.search(r"grpc listening on (\S+:\d+)", line)
            if match:
                self.address = match.group(1)
                self.listening.set()
        self.listening.set()  # it exited: wake start() up

    def _wait_serving(self, deadline: float) -> None:
        import grpc
        from grpc_health.v1 import health_pb2, health_pb2_grpc
        with grpc.insecure_channel(self.address) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            while time.monotonic() < deadline and self.proc.poll() is None and not self.crashed:
                try:
                    check = health.Check(health_pb2.HealthCheckRequest(service=GENERATION_SERVICE), timeout=5)
                    if check.status == health_pb2.HealthCheckResponse.SERVING:
                        return
                except grpc.RpcError:
                    pass  # not up yet: poll again
                time.sleep(0.2)
        self._fail(f"{GENERATION_SERVICE} never became SERVING")

    def _fail(self, why: str) -> None:
        self.stop()
        raise RuntimeError(f"pagedserve serve {why}; its last output:\n" + "".join(self.tail))


def engine_flags(config: EngineConfig) -> list[str]:
    """The command-line flags that rebuild `config` (see engine.arg_utils)."""
    flags = []
    for f in fields(EngineConfig):
        value, flag = getattr(config, f.name), "--" + f.name.replace("_", "-")
        if isinstance(value, bool):
            flags.append(flag if value else "--no-" + flag[2:])
        elif value is not None:
            flags += [flag, str(value)]
    return flags


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _run_grpc(address: str, args: argparse.Namespace):
    """Every prompt through Generate, --max-concurrency at a time, after a small warm-up."""
    import grpc
    from pagedserve.v1 import generation_pb2_grpc, info_pb2, info_pb2_grpc
    async with grpc.aio.insecure_channel(address) as channel:
        info = info_pb2_grpc.InfoStub(channel)
        try:
            model = await info.GetModelInfo(info_pb2.GetModelInfoRequest(), timeout=30)
        except grpc.aio.AioRpcError as e:
            raise SystemExit(f"GetModelInfo on {address} failed: {e.code().name}: {e.details()}") from e
        prompts = random_prompts(args.num_prompts, args.input_len, model.vocab_size, args.seed)
        stub = generation_pb2_grpc.GenerationStub(channel)
        # Other prompts than the timed ones: the warm-up must not fill the prefix cache for them.
        warmup = random_prompts(2, args.input_len, model.vocab_size, args.seed + 1)
        await asyncio.gather(*(_generate(stub, p, 4) for p in warmup))
        limit = asyncio.Semaphore(args.max_concurrency)
        bar = tqdm(total=len(prompts), desc="grpc requests", unit="req")

        async def one(prompt: list[int]) -> RequestRecord:
            async with limit:
                record = await _generate(stub, prompt, args.output_len)
            bar.update(1)
            return record

        start = time.perf_counter()
        records = await asyncio.gather(*(one(p) for p in prompts))
        duration_s = time.perf_counter() - start
        bar.close()
    model_json = {"model_name": model.model_name, "architecture": model.architecture,
                  "dtype": model.dtype, "vocab_size": model.vocab_size}
    return list(records), duration_s, model_json


async def _generate(stub, prompt: list[int], max_tokens: int) -> RequestRecord:
    import grpc
    from pagedserve.v1 import generation_pb2 as gen
    request = gen.GenerateRequest(
        token_ids=gen.TokenIds(ids=prompt),
        sampling=gen.SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    record = RequestRecord(prompt_tokens=len(prompt))
    start = time.perf_counter()
    try:
        async for response in stub.Generate(request):
            now = time.perf_counter() - start
            kind = response.WhichOneof("kind")
            if kind == "started":
                record.cached_tokens = response.started.cached_tokens
            elif kind == "chunk" and response.chunk.token_ids:
                if not record.token_times_s:
                    record.ttft_s = now
                record.token_times_s += [now] * len(response.chunk.token_ids)
            elif kind == "finished":
                record.ok = True
    except grpc.aio.AioRpcError as e:
        record.code, record.error = e.code().name, e.details() or ""
    record.e2e_s = time.perf_counter() - start
    if not record.ok and not record.error:
        record.code, record.error = "UNKNOWN", "stream ended without Finished"
    return record


def summarize(records: list[RequestRecord], duration_s: float) -> dict:
    """Aggregates over the completed requests; latencies in ms."""
    done = [r for r in records if r.ok]
    output_tokens = sum(r.num_output_tokens for r in done)
    prompt_tokens = sum(r.prompt_tokens for r in done)
    ttft = [r.ttft_s * 1000 for r in done if r.num_output_tokens]
    tpot = [(r.e2e_s - r.ttft_s) * 1000 / (r.num_output_tokens - 1) for r in done if r.num_output_tokens > 1]
    itl = [(b - a) * 1000 for r in done for a, b in zip(r.token_times_s, r.token_times_s[1:])]
    return {
        "completed": len(done), "failed": len(records) - len(done),
        "errors": dict(collections.Counter(r.code for r in records if not r.ok)),
        "duration_s": duration_s, "output_tokens": output_tokens, "prompt_tokens": prompt_tokens,
        "cached_tokens": sum(r.cached_tokens for r in done),
        "request_throughput": len(done) / duration_s,
        "output_tok_s": output_tokens / duration_s,
        "total_tok_s": (output_tokens + prompt_tokens) / duration_s,
        **_stats("ttft_ms", ttft, ("mean", "median", "p99")),
        **_stats("tpot_ms", tpot, ("mean", "median", "p99")),
        **_stats("itl_ms", itl, ("median", "p99")),
    }


def _stats(name: str, values: list[float], which: tuple[str, ...]) -> dict:
    if not values:
        return {f"{stat}_{name}": None for stat in which}
    compute = {"mean": np.mean, "median": np.median, "p99": lambda v: np.percentile(v, 99)}
    return {f"{stat}_{name}": float(compute[stat](values)) for stat in which}


def _report(summary: dict, offline: dict | None, ratios: dict) -> None:
    rows = [["completed / failed", f"{summary['completed']} / {summary['failed']}"],
            ["duration (s)", summary["duration_s"]],
            ["request throughput (req/s)", summary["request_throughput"]],
            ["output throughput (tok/s)", summary["output_tok_s"]],
            ["total throughput (tok/s)", summary["total_tok_s"]]]
    for metric, label in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL")):
        for stat in ("mean", "median", "p99"):
            key = f"{stat}_{metric}"
            if key in summary:
                rows.append([f"{label} {stat} (ms)", "n/a" if summary[key] is None else summary[key]])
    if offline:
        rows.append([f"offline, {offline['max_num_seqs']} seqs at most (tok/s)", offline["output_tok_s"]])
        rows.append(["offline, all prompts at once (tok/s)", offline["all_at_once"]["output_tok_s"]])
    print()
    print_table(["metric", "value"], rows)
    if summary["errors"]:
        print(f"\nfailed requests by code: {summary['errors']}")
    if ratios:
        print(f"\ngrpc / offline output throughput = {ratios['grpc_vs_offline_output_tok_s'] * 100:.1f}% "
              f"(same concurrency); {ratios['grpc_vs_offline_all_at_once_output_tok_s'] * 100:.1f}% "
              f"of offline with all prompts at once")
