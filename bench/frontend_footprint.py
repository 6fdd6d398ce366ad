"""Frontend footprint: how long `pagedserve frontend` takes from spawn until its Generation
service is SERVING, and its memory after serving one request.

Each tree gets its own engine; then the frontend starts --runs times against it. Start-up
counts everything a user waits for: interpreter, imports, the gRPC server, the engine
handshake and the tokenizer. With --pythonpath, a second tree (a git worktree of an older
commit) is measured the same way as the baseline, with the same interpreter:

    git worktree add /tmp/before a8ed39e
    python -m bench.frontend_footprint --pythonpath /tmp/before
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from bench.reporting import machine_info, median, print_table, write_result

ROOT = Path(__file__).resolve().parents[1]
GENERATION = "pagedserve.v1.Generation"
# The e2e tests' engine: float32, one torch thread (the cores are shared).
ENGINE_FLAGS = "--dtype float32 --num-kv-blocks 512 --max-model-len 2048 --num-threads 1"


@dataclass
class Tree:
    label: str
    path: Path
    python: str

    def spawn(self, *args: str) -> subprocess.Popen:
        """`pagedserve ARGS` from this tree (cwd and PYTHONPATH), output on a pipe."""
        env = {**os.environ, "PYTHONPATH": str(self.path), "PYTHONUNBUFFERED": "1"}
        return subprocess.Popen([self.python, "-m", "pagedserve", *args], cwd=self.path, env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def git(self) -> dict:
        def run(*cmd: str) -> str:
            return subprocess.run(["git", "-C", str(self.path), *cmd], capture_output=True, text=True).stdout.strip()
        return {"commit": run("rev-parse", "HEAD"), "dirty": bool(run("status", "--porcelain", "--untracked-files=no"))}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--python", default=sys.executable,
                   help="the interpreter for every process (default: this one)")
    p.add_argument("--pythonpath", type=Path, default=None,
                   help="a second source tree to measure as the baseline, e.g. a git worktree of an older "
                        "commit (default: only this tree)")
    p.add_argument("--runs", type=int, default=3, help="frontend starts per tree (default: 3)")
    p.add_argument("--engine-flags", default=ENGINE_FLAGS, help=f"engine flags (default: {ENGINE_FLAGS!r})")
    p.add_argument("--timeout-s", type=float, default=180.0,
                   help="longest wait for an engine or a frontend to come up (default: 180)")
    p.add_argument("--out-dir", type=Path, default=None, help="where the JSON goes (default: bench/results)")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.frontend_footprint", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1])
    add_arguments(p)
    args = p.parse_args(argv)
    load_at_start = os.getloadavg()[0]  # other work on the machine skews start-up times
    trees = [Tree("current", ROOT, args.python)]
    if args.pythonpath is not None:
        trees.insert(0, Tree("baseline", args.pythonpath.resolve(), args.python))
    results = []
    for tree in trees:
        print(f"{tree.label}: {tree.path}", flush=True)
        runs = measure_tree(tree, args.runs, shlex.split(args.engine_flags), args.timeout_s)
        results.append({"label": tree.label, "path": str(tree.path), **tree.git(), "runs": runs,
                        "median_startup_s": median([r["startup_s"] for r in runs]),
                        "median_rss_mb": median([r["rss_mb"] for r in runs]),
                        "median_uss_mb": median([r["uss_mb"] for r in runs])})
    report(results)
    path = write_result("frontend-footprint", {
        "machine": machine_info("cpu"), "python": args.python, "engine_flags": args.engine_flags,
        "load_avg_1m": [load_at_start, os.getloadavg()[0]], "trees": results}, args.out_dir)
    print(f"wrote {path}")
    return 0


def measure_tree(tree: Tree, runs: int, engine_flags: list[str], timeout_s: float) -> list[dict]:
    address = f"tcp://127.0.0.1:{free_port()}"
    engine = tree.spawn("engine", "--address", address, *engine_flags)
    log = drain(engine)
    try:
        wait_engine(tree, engine, address, timeout_s, log)
        return [measure_frontend(tree, address, timeout_s) for _ in range(runs)]
    finally:
        stop(engine)


def measure_frontend(tree: Tree, engine_address: str, timeout_s: float) -> dict:
    import psutil
    start = time.perf_counter()
    proc = tree.spawn("frontend", "--engine-address", engine_address, "--grpc-port", "0")
    log = drain(proc)
    try:
        grpc_address, listen_s = wait_listening(proc, log, start, timeout_s)
        wait_serving(grpc_address, start + timeout_s)
        startup_s = time.perf_counter() - start
        num_tokens = generate_once(grpc_address)
        info = psutil.Process(proc.pid).memory_full_info()
        torch_mapped = "libtorch" in Path(f"/proc/{proc.pid}/maps").read_text()
    finally:
        exit_code = stop(proc)
    row = {"startup_s": round(startup_s, 3), "listen_s": round(listen_s, 3), "rss_mb": round(info.rss / 2**20, 1),
           "uss_mb": round(info.uss / 2**20, 1), "torch_mapped": torch_mapped, "tokens": num_tokens,
           "exit_code": exit_code}
    print(f"  {row}", flush=True)
    return row


def wait_engine(tree: Tree, engine: subprocess.Popen, address: str, timeout_s: float, log: list[str]) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if engine.poll() is not None:
            raise RuntimeError("the engine exited:\n" + "".join(log[-30:]))
        ping = tree.spawn("ping-engine", "--address", address, "--timeout-s", "2")
        if ping.wait() == 0:
            return
        time.sleep(0.5)
    raise TimeoutError(f"engine at {address} did not answer within {timeout_s}s")


def wait_listening(proc: subprocess.Popen, log: list[str], start: float, timeout_s: float) -> tuple[str, float]:
    """The frontend's `grpc listening on HOST:PORT` line, and seconds from spawn to it."""
    while time.perf_counter() - start < timeout_s:
        for line in list(log):
            if line.startswith("grpc listening on "):
                return line.split()[-1], time.perf_counter() - start
        if proc.poll() is not None:
            raise RuntimeError("the frontend exited:\n" + "".join(log[-30:]))
        time.sleep(0.01)
    raise TimeoutError("the frontend never listened")


def wait_serving(address: str, deadline: float) -> None:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    with grpc.insecure_channel(address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        while time.perf_counter() < deadline:
            try:
                status = health.Check(health_pb2.HealthCheckRequest(service=GENERATION), timeout=2).status
                if status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.02)
    raise TimeoutError(f"{address} never became SERVING")


def generate_once(address: str) -> int:
    import grpc

    from common.v1 import generation_pb2 as gen
    from common.v1 import generation_pb2_grpc
    with grpc.insecure_channel(address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        req = gen.GenerateRequest(text="The capital of France is",
                                  sampling=gen.SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
        messages = list(stub.Generate(req, timeout=120))
    tokens = sum(len(m.chunk.token_ids) for m in messages if m.HasField("chunk"))
    if tokens != 8:
        raise RuntimeError(f"expected 8 tokens, got {tokens}: {messages}")
    return tokens


def report(results: list[dict]) -> None:
    rows = []
    for r in results:
        for i, run in enumerate(r["runs"]):
            rows.append([r["label"], i, run["listen_s"], run["startup_s"], run["rss_mb"], run["uss_mb"],
                         "yes" if run["torch_mapped"] else "no"])
        rows.append([r["label"], "median", median([x["listen_s"] for x in r["runs"]]), r["median_startup_s"],
                     r["median_rss_mb"], r["median_uss_mb"], ""])
    print_table(["tree", "run", "listening s", "SERVING s", "RSS MB", "USS MB", "torch"], rows)


def drain(proc: subprocess.Popen) -> list[str]:
    """Read a child's output on a thread (a full pipe would block it); returns the growing list."""
    lines: list[str] = []

    def read() -> None:
        for line in proc.stdout:
            lines.append(line)

    threading.Thread(target=read, daemon=True).start()
    return lines


def stop(proc: subprocess.Popen, timeout_s: float = 30) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    sys.exit(main())
