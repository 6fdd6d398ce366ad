"""`pagedserve bench scaling`: one engine against several, behind one frontend, at saturation.

For each --engines count N, this starts N `pagedserve engine` processes (each with
--num-threads threads, default 1, its own endpoint and /metrics) and one `pagedserve frontend` over
all of them, then sends a closed loop of random-token requests: --concurrency-per-engine × N in
flight, --prompts-per-engine × N in all, so every engine is kept full and every run lasts
about as long. Every count gets the same kind of prompts (seeded) and a warm-up.

What it measures, per count:
- output tokens/s, TTFT p50/p99, TPOT p50;
- efficiency against one engine: throughput(N) / (N × throughput(1));
- the CPU seconds each process spent per output token (engines, frontend, this client), read
  from /proc before and after the timed run, and the cores they kept busy: on a machine whose
  cores the engines, the frontend and the client all share, that is what bounds efficiency;
- each engine's share of the generated tokens, from its own /metrics.

Prints one table and writes scaling-<stamp>.json (with the CPU flags) and a PNG.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from bench.datasets import prefix_repetition_requests, random_requests
from bench.load import generate, run_load
from bench.serve_metrics import summarize
from bench.servers import ServerProcess, engine_flags, free_port
from engine.arg_utils import add_engine_args, engine_config_from_args
from engine.config import EngineConfig

ENGINE_START_TIMEOUT_S = 300
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
COUNTERS = ("generation_tokens", "prefix_cache_queries", "prefix_cache_hits")  # read from each engine


@dataclass
class Cluster:
    """The processes of one count: engines and their /metrics URLs, and the frontend."""

    engines: list[subprocess.Popen]
    metrics_urls: list[str]
    frontend: ServerProcess
    address: str  # the frontend's gRPC address

    def pids(self) -> dict[str, int]:
        pids = {f"engine{i}": p.pid for i, p in enumerate(self.engines)}
        return {**pids, "frontend": self.frontend.proc.pid, "client": os.getpid()}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--engines", default="1,2", metavar="N[,N]",
                   help="engine counts to run, each behind one frontend; the first is the baseline of the "
                        "efficiency figure (default: 1,2)")
    p.add_argument("--routing-policies", default="cache_aware", metavar="NAME[,NAME]",
                   help="the frontend's --routing-policy: with several, each count above 1 runs once per "
                        "policy (one engine needs no routing) (default: cache_aware)")
    p.add_argument("--dataset", choices=("random", "prefix"), default="random",
                   help="random: random token ids; prefix: --num-prefixes shared prefixes of --prefix-len "
                        "tokens, each prompt one of them + --input-len tokens of its own, where routing "
                        "decides how often a prefix is computed again (default: random)")
    p.add_argument("--prefix-len", type=int, default=512, help="prefix: shared prefix tokens (default: 512)")
    p.add_argument("--num-prefixes", type=int, default=16, help="prefix: distinct prefixes (default: 16)")
    p.add_argument("--concurrency-per-engine", type=int, default=16,
                   help="requests in flight per engine: enough to keep its batch full (default: 16)")
    p.add_argument("--prompts-per-engine", type=int, default=48, help="requests per engine per run (default: 48)")
    p.add_argument("--input-len", type=int, default=128, help="prompt tokens, random ids (default: 128)")
    p.add_argument("--output-len", type=int, default=128, help="output tokens, eos ignored (default: 128)")
    p.add_argument("--seed", type=int, default=0, help="seed of the prompts (default: 0)")
    p.add_argument("--output-dir", type=Path, default=None, help="where to write JSON and PNG (default: bench/results)")
    add_engine_args(p, dtype="auto")
    p.set_defaults(num_threads=1)
    for action in p._actions:
        if action.dest == "num_threads":
            action.help = "threads of every engine: one core each, so N engines ask for N cores (default: 1)"


def run(args: argparse.Namespace) -> int:
    from bench.scaling_report import report
    counts = check_args(args)
    base = engine_config_from_args(args)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))  # stop the servers too
    runs, commands = [], {}
    for n, policy in plan(counts, args.routing_policies.split(",")):
        with _cluster(base, n, policy) as (cluster, command):
            commands[f"{n}:{policy}"] = command
            runs.append({"routing_policy": policy, **_timed_run(cluster, n, args)})
    report(runs, commands, base, args)
    return 0 if all(r["summary"]["failed"] == 0 for r in runs) else 1


def plan(counts: list[int], policies: list[str]) -> list[tuple[int, str]]:
    """(engines, routing policy) of each run, in order: one engine once, more once per policy."""
    return [(n, p) for n in counts for p in (policies[:1] if n == 1 else policies)]


def check_args(args: argparse.Namespace) -> list[int]:
    try:
        counts = [int(c) for c in args.engines.split(",") if c.strip()]
    except ValueError:
        counts = []
    if not counts or min(counts) < 1 or len(set(counts)) != len(counts):
        raise SystemExit(f"bench scaling: --engines: a comma list of distinct positive integers, got {args.engines!r}")
    for flag, value in (("--num-threads", args.num_threads), ("--input-len", args.input_len),
                        ("--output-len", args.output_len), ("--prompts-per-engine", args.prompts_per_engine),
                        ("--concurrency-per-engine", args.concurrency_per_engine),
                        ("--num-prefixes", args.num_prefixes)):
        if value < 1:
            raise SystemExit(f"bench scaling: {flag}: must be at least 1, got {value}")
    return counts


@contextlib.contextmanager
def _cluster(config: EngineConfig, n: int, policy: str) -> Iterator[tuple[Cluster, dict]]:
    """N engines and a frontend over them, all ready; stopped (SIGTERM) on the way out."""
    from pagedserve.health import ping_engine
    addresses = [f"tcp://127.0.0.1:{free_port()}" for _ in range(n)]
    metrics_ports = [free_port() for _ in range(n)]
    engine_cmds = [[sys.executable, "-m", "pagedserve", "engine", "--address", a, "--metrics-port", str(port),
                    *engine_flags(config)] for a, port in zip(addresses, metrics_ports)]
    frontend_cmd = [sys.executable, "-m", "pagedserve", "frontend", "--grpc-port", "0", "--http-port", "off",
                    "--routing-policy", policy, "--max-concurrent-streams", "1024"]
    for a in addresses:
        frontend_cmd += ["--engine-address", a]
    print(f"\n== {n} engine(s), {policy}: {' '.join(engine_cmds[0][1:])}", flush=True)
    engines = [subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for cmd in engine_cmds]
    frontend = ServerProcess("pagedserve frontend", frontend_cmd)
    try:
        deadline = time.monotonic() + ENGINE_START_TIMEOUT_S
        for address, proc in zip(addresses, engines):  # an engine binds once its model is loaded
            while ping_engine(address, 1.0) is None:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the engine at {address} did not start (exit code {proc.poll()})")
        address = frontend.start()
        _wait_all_routed(address, n, deadline)
        cluster = Cluster(engines, [f"http://127.0.0.1:{p}/metrics" for p in metrics_ports], frontend, address)
        yield cluster, {"engines": [c[1:] for c in engine_cmds], "frontend": frontend_cmd[1:]}
    finally:
        frontend.stop()
        for proc in engines:
            proc.send_signal(signal.SIGTERM)
        for proc in engines:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()


def _wait_all_routed(address: str, n: int, deadline: float) -> None:
    """Until the frontend has the handshake of all N engines (it is SERVING from the first one on)."""
    import grpc

    from common.v1 import info_pb2, info_pb2_grpc
    with grpc.insecure_channel(address) as channel:
        stub = info_pb2_grpc.InfoStub(channel)
        while time.monotonic() < deadline:
            engines = stub.GetServerInfo(info_pb2.GetServerInfoRequest(), timeout=10).engines
            if sum(bool(e.id) for e in engines) >= n:  # an engine's id is known once it has answered
                return
            time.sleep(0.2)
    raise RuntimeError(f"the frontend at {address} never listed {n} engines")


def _timed_run(cluster: Cluster, n: int, args: argparse.Namespace) -> dict:
    import grpc

    from bench.serve_workload import grpc_model_info
    from common.v1 import generation_pb2_grpc
    with grpc.insecure_channel(cluster.address) as channel:
        model = grpc_model_info(channel, cluster.address)
    requests = _requests(n * args.prompts_per_engine, model["vocab_size"], f"{args.seed}:n{n}", args)
    warmup = random_requests(2 * n, args.input_len, 8, 0.0, model["vocab_size"], f"{args.seed}:n{n}:warmup")
    concurrency = n * args.concurrency_per_engine
    cpu = {}

    async def go():
        async with grpc.aio.insecure_channel(cluster.address) as channel:
            send = functools.partial(generate, generation_pb2_grpc.GenerationStub(channel))
            await asyncio.gather(*(send(r) for r in warmup))
            cpu["before"], counters_before = cpu_seconds(cluster.pids()), engine_counters(cluster.metrics_urls)
            out = await run_load(send, requests, [0.0] * len(requests), concurrency, desc=f"{n} engine(s)")
            cpu["after"] = cpu_seconds(cluster.pids())
            return out, counters_before

    (records, duration_s), counters_before = asyncio.run(go())
    time.sleep(0.2)  # let each engine record its last step before reading its counters
    counters = [{k: after[k] - before[k] for k in COUNTERS}
                for before, after in zip(counters_before, engine_counters(cluster.metrics_urls))]
    summary = summarize(records, duration_s)
    spent = {name: cpu["after"][name] - cpu["before"][name] for name in cpu["after"]}
    return {"engines": n, "concurrency": concurrency, "num_requests": len(requests), "model": model,
            "summary": summary, "cpu_s": spent, "engine_counters": counters}


def _requests(num: int, vocab_size: int, seed: str, args: argparse.Namespace) -> list:
    if args.dataset == "prefix":
        return prefix_repetition_requests(num, args.prefix_len, args.input_len, args.num_prefixes,
                                          args.output_len, vocab_size, seed)
    return random_requests(num, args.input_len, args.output_len, 0.0, vocab_size, seed)


def cpu_seconds(pids: dict[str, int]) -> dict[str, float]:
    """User + system CPU seconds of each process so far (threads included), from /proc."""
    out = {}
    for name, pid in pids.items():
        # The command name (field 2) may hold spaces: the counters follow its closing parenthesis.
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        out[name] = (int(fields[11]) + int(fields[12])) / CLOCK_TICKS  # utime, stime
    return out


def engine_counters(urls: list[str]) -> list[dict[str, float]]:
    """Each engine's COUNTERS from its /metrics (summed over their labels)."""
    from prometheus_client.parser import text_string_to_metric_families
    out = []
    for url in urls:
        with urllib.request.urlopen(url, timeout=10) as reply:
            text = reply.read().decode()
        samples = [s for family in text_string_to_metric_families(text) for s in family.samples]
        out.append({k: sum(s.value for s in samples if s.name == f"pagedserve:{k}_total") for k in COUNTERS})
    return out
