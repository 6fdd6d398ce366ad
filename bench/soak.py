"""`pagedserve bench soak`: a long run of mixed load with cancels, watching for leaks.

It starts `pagedserve serve` (with the engine flags given) and for --minutes keeps
--concurrency Generate streams in flight: random token-id prompts (4-64 tokens), 1-32 output
tokens, greedy or seeded sampling, a share cancelled mid-stream (--cancel-ratio) and a share
with deadlines too short to finish (--deadline-ratio). Every --sample-s it records the RSS of
the frontend and the engine, KV-cache usage, and requests by outcome. At the end it waits for
the engine to go idle, then checks:
  - every KV block is free, and nothing runs or waits;
  - no request failed in a way it should not have (a short answer, an unexpected code);
  - each process's RSS grew less than --max-rss-growth after the warm-up
    (median of the last samples against the median of the first ones after warm-up).
It writes JSON and a PNG under --output-dir and exits 1 if a check fails.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import random
import statistics
import time
from dataclasses import dataclass, field

import grpc
import psutil
from tqdm import tqdm

from bench.reporting import machine_info, print_table, write_result
from bench.servers import server_for
from engine.arg_utils import add_engine_args, engine_config_from_args

RSS_WINDOW = 5  # samples averaged (median) at each end of the growth comparison


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--minutes", type=float, default=30.0, help="length of the load (default: 30)")
    p.add_argument("--warmup-minutes", type=float, default=None,
                   help="load before the RSS baseline is taken (default: a sixth of --minutes, at most 5)")
    p.add_argument("--concurrency", type=int, default=32, help="streams in flight (default: 32)")
    p.add_argument("--cancel-ratio", type=float, default=0.2, help="share cancelled mid-stream (default: 0.2)")
    p.add_argument("--deadline-ratio", type=float, default=0.05,
                   help="share sent with a deadline too short to finish (default: 0.05)")
    p.add_argument("--sample-s", type=float, default=5.0, help="seconds between samples (default: 5)")
    p.add_argument("--max-rss-growth", type=float, default=0.10,
                   help="largest allowed RSS growth after warm-up, as a fraction (default: 0.10)")
    p.add_argument("--seed", type=int, default=0, help="seed of the request mix (default: 0)")
    p.add_argument("--output-dir", default=None, help="where to write JSON and PNG (default: bench/results)")
    add_engine_args(p, dtype="auto", num_kv_blocks=1024)


@dataclass
class Tally:
    """Requests by outcome, and the unexpected ones in detail (the first few)."""

    outcomes: collections.Counter = field(default_factory=collections.Counter)
    unexpected: list[str] = field(default_factory=list)

    def bad(self, what: str) -> None:
        self.outcomes["unexpected"] += 1
        if len(self.unexpected) < 20:
            self.unexpected.append(what)


def run(args: argparse.Namespace) -> int:
    warmup_min = args.warmup_minutes if args.warmup_minutes is not None else min(5.0, args.minutes / 6)
    if not 0 <= warmup_min < args.minutes:
        raise SystemExit("--warmup-minutes must be at least 0 and less than --minutes")
    config = engine_config_from_args(args)
    server = server_for("pagedserve", config, max_concurrent_streams=max(256, 2 * args.concurrency))
    try:
        address = server.start()
        frontend = psutil.Process(server.proc.pid)
        engine = next(c for c in frontend.children() if "engine" in c.cmdline())
        samples, tally, idle = asyncio.run(_soak(address, args, frontend, engine))
    finally:
        server.stop()
    report = _report(samples, tally, idle, warmup_min * 60, args)
    path = write_result("soak", {"machine": machine_info(config.device), "engine_config": vars(config),
                                 "args": {k: v for k, v in vars(args).items() if k not in ("command", "bench")},
                                 **report, "samples": samples}, args.output_dir)
    from bench.plots import plot_soak
    chart = plot_soak(samples, warmup_min * 60, f"pagedserve bench soak, {args.minutes:g} min, "
                                                f"{args.concurrency} streams; {machine_info()['cpu']}",
                      path.with_suffix(".png"))
    print(f"\nwrote {path} and {chart.name}")
    return 0 if report["passed"] else 1


async def _soak(address: str, args: argparse.Namespace, frontend: psutil.Process, engine: psutil.Process):
    from common.v1 import generation_pb2_grpc, info_pb2_grpc
    tally, samples = Tally(), []
    async with grpc.aio.insecure_channel(address) as channel:
        stub, info = generation_pb2_grpc.GenerationStub(channel), info_pb2_grpc.InfoStub(channel)
        start = time.monotonic()
        end = start + args.minutes * 60
        rng = random.Random(args.seed)
        workers = [asyncio.create_task(_worker(stub, random.Random(rng.random()), end, args, tally))
                   for _ in range(args.concurrency)]
        with tqdm(total=round(args.minutes * 60), desc="soak", unit="s") as bar:
            while time.monotonic() < end:
                samples.append(await _sample(info, frontend, engine, tally, time.monotonic() - start))
                bar.n = min(bar.total, round(time.monotonic() - start))
                bar.set_postfix(done=tally.outcomes["ok"], bad=tally.outcomes["unexpected"])
                await asyncio.sleep(min(args.sample_s, max(0.0, end - time.monotonic())))
        await asyncio.gather(*workers)
        idle = await _wait_idle(info)
        samples.append(await _sample(info, frontend, engine, tally, time.monotonic() - start))
    return samples, tally, idle


async def _worker(stub, rng: random.Random, end: float, args: argparse.Namespace, tally: Tally) -> None:
    from common.v1 import generation_pb2 as gen
    while time.monotonic() < end:
        max_tokens = rng.randint(1, 32)
        seeded = rng.random() < 0.5
        request = gen.GenerateRequest(
            token_ids=gen.TokenIds(ids=[rng.randrange(100, 40000) for _ in range(rng.randint(4, 64))]),
            sampling=gen.SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.7 if seeded else 0,
                                        **({"seed": rng.randrange(2**31)} if seeded else {})))
        roll = rng.random()
        cancel_after = rng.randint(0, max_tokens) if roll < args.cancel_ratio else None
        short_deadline = args.cancel_ratio <= roll < args.cancel_ratio + args.deadline_ratio
        await _one(stub, request, max_tokens, cancel_after, 0.02 if short_deadline else 300, tally)


async def _one(stub, request, max_tokens: int, cancel_after: int | None, timeout_s: float, tally: Tally) -> None:
    call = stub.Generate(request, timeout=timeout_s)
    tokens, finished = 0, None
    try:
        async for response in call:
            if response.HasField("chunk"):
                tokens += len(response.chunk.token_ids)
            elif response.HasField("finished"):
                finished = response.finished
            if cancel_after is not None and tokens >= cancel_after and finished is None:
                call.cancel()
    except asyncio.CancelledError:
        tally.outcomes["cancelled"] += 1
        return
    except grpc.aio.AioRpcError as e:
        expected = (e.code() == grpc.StatusCode.DEADLINE_EXCEEDED and timeout_s < 1
                    or e.code() == grpc.StatusCode.CANCELLED and cancel_after is not None)
        if expected:
            tally.outcomes["deadline" if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED else "cancelled"] += 1
        else:
            tally.bad(f"{e.code().name}: {e.details()}")
        return
    if finished is None or tokens != max_tokens or finished.usage.completion_tokens != max_tokens:
        tally.bad(f"short answer: {tokens} of {max_tokens} tokens, finished={finished is not None}")
    else:
        tally.outcomes["ok"] += 1


async def _sample(info, frontend: psutil.Process, engine: psutil.Process, tally: Tally, t_s: float) -> dict:
    from common.v1 import info_pb2
    s = await info.GetServerInfo(info_pb2.GetServerInfoRequest(), timeout=30)
    return {"t_s": round(t_s, 2), "frontend_rss_mb": frontend.memory_info().rss / 2**20,
            "engine_rss_mb": engine.memory_info().rss / 2**20,
            "kv_usage": 1 - s.kv_blocks_free / s.kv_blocks_total, "num_running": s.num_running,
            "num_waiting": s.num_waiting, **{k: tally.outcomes[k] for k in ("ok", "cancelled", "deadline",
                                                                              "unexpected")}}


async def _wait_idle(info, timeout_s: float = 30) -> dict:
    """The engine's state once nothing runs (stats arrive with the 0.5 s heartbeat)."""
    from common.v1 import info_pb2
    deadline = time.monotonic() + timeout_s
    while True:
        s = await info.GetServerInfo(info_pb2.GetServerInfoRequest(), timeout=30)
        idle = s.kv_blocks_free == s.kv_blocks_total and not s.num_running and not s.num_waiting
        if idle or time.monotonic() > deadline:
            return {"kv_blocks_free": s.kv_blocks_free, "kv_blocks_total": s.kv_blocks_total,
                    "num_running": s.num_running, "num_waiting": s.num_waiting}
        await asyncio.sleep(0.5)


def rss_growth(samples: list[dict], key: str, warmup_s: float) -> float:
    """Median of the last RSS_WINDOW samples over the median of the first RSS_WINDOW after warm-up."""
    after = [s[key] for s in samples if s["t_s"] >= warmup_s]
    if len(after) < 2 * RSS_WINDOW:
        raise SystemExit(f"too few samples after warm-up ({len(after)}) to judge RSS growth: "
                         f"lower --sample-s or raise --minutes")
    return statistics.median(after[-RSS_WINDOW:]) / statistics.median(after[:RSS_WINDOW]) - 1


def _report(samples: list[dict], tally: Tally, idle: dict, warmup_s: float, args: argparse.Namespace) -> dict:
    growth = {p: rss_growth(samples, f"{p}_rss_mb", warmup_s) for p in ("frontend", "engine")}
    checks = {
        "kv_blocks_all_free": idle["kv_blocks_free"] == idle["kv_blocks_total"],
        "nothing_running_or_waiting": idle["num_running"] == 0 and idle["num_waiting"] == 0,
        "no_unexpected_errors": tally.outcomes["unexpected"] == 0,
        **{f"{p}_rss_growth_below_{args.max_rss_growth:g}": g < args.max_rss_growth for p, g in growth.items()},
    }
    rows = [[name, "ok" if passed else "FAILED"] for name, passed in checks.items()]
    rows += [[f"{p} RSS growth after warm-up", f"{g * 100:+.1f}%"] for p, g in growth.items()]
    rows += [[f"requests {k}", tally.outcomes[k]] for k in ("ok", "cancelled", "deadline", "unexpected")]
    print()
    print_table(["check", "result"], rows)
    for line in tally.unexpected:
        print(f"  unexpected: {line}")
    return {"passed": all(checks.values()), "checks": checks, "rss_growth": growth, "idle": idle,
            "outcomes": dict(tally.outcomes), "unexpected": tally.unexpected, "warmup_s": warmup_s}
