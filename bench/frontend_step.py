"""`python -m bench.frontend_step`: the frontend's work per engine step at 256 streams.

Under load the engine sends each frontend one message per step: a token for each of its
streams. This measures what the frontend then does, in its own process: the real AsyncLLM,
EnginePool and EngineClient, over a real ZeroMQ socket that this benchmark answers as an
engine would (a ROUTER in the same event loop, uvloop as the server runs). It admits
`--num-streams` greedy requests, each iterated through `AsyncLLM.generate` as an API does (the
deltas are counted, not written to a client), then sends one serialized step (one plain token
per stream, real BPE ids of the bundled tokenizer) and times until every stream has its
token: wall time and this process's CPU time per step, the first fifth of the steps left out.

`--baseline REF` measures a git commit the same way, alternating runs (each a fresh process)
with this tree's, as `bench host-step --baseline` does; each keeps its best run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--num-streams", type=int, default=256, help="concurrent streams (default: 256)")
    p.add_argument("--steps", type=int, default=300, help="engine steps sent per run (default: 300)")
    p.add_argument("--repeats", type=int, default=5, help="runs per build; the best is kept (default: 5)")
    p.add_argument("--baseline", default=None, metavar="REF", help="also measure this git commit, alternating")
    p.add_argument("--output-dir", default=None, help="where to write JSON (default: bench/results)")
    # Internal: one run in this process, its JSON on stdout (see --baseline).
    p.add_argument("--measure-only", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--tokenizer", default=None, help=argparse.SUPPRESS)


async def measure(tokenizer: str, num_streams: int, steps: int) -> dict:
    """One run: per-step wall and CPU milliseconds (median wall, mean CPU) after a warm-up fifth."""
    import zmq
    import zmq.asyncio

    from common.sampling_params import SamplingParams
    from common.v1 import engine_ipc_pb2 as ipc
    from frontend.async_llm import AsyncLLM
    from frontend.engine_pool import EnginePool
    from frontend.router import make_policy
    ctx = zmq.asyncio.Context()
    engine = ctx.socket(zmq.ROUTER)
    engine.bind("tcp://127.0.0.1:*")
    address = engine.getsockopt(zmq.LAST_ENDPOINT).decode()
    llm = AsyncLLM(None, num_streams, tokenizer)
    llm.pool = EnginePool(make_policy("round_robin"), "bench", "", 0.5, 60.0, None, llm.on_welcome)
    await llm.pool.start([address])
    identity, _ = await engine.recv_multipart()  # Hello
    welcome = ipc.Welcome(engine_id="bench", model_name="bench", max_model_len=1 << 20, block_size=16,
                          vocab_size=49152, eos_token_ids=[0], kv_blocks_total=1 << 20)
    await engine.send_multipart([identity, ipc.EngineResponse(welcome=welcome).SerializeToString()])
    while not llm.ready:
        await asyncio.sleep(0.01)
    received = [0]

    async def consume(gen) -> None:
        async for deltas in llm.generate(gen):
            for delta in deltas:
                received[0] += len(delta.token_ids)

    params = SamplingParams(temperature=0.0, max_tokens=steps + 1, ignore_eos=True)
    tasks = [asyncio.create_task(consume(llm.admit([100 + i, 200, 300], params))) for i in range(num_streams)]
    ids = await _added_ids(engine, num_streams, ipc)
    messages = [ipc.EngineResponse(outputs=ipc.OutputBatch(
        token_request_ids=ids, token_ids=[100 + (step * 7 + i) % 900 for i in range(num_streams)],
        token_num_cached_tokens=[0] * num_streams)).SerializeToString() for step in range(steps)]
    wall, cpu = [], []
    for message in messages:
        target = received[0] + num_streams
        start_wall, start_cpu = time.perf_counter(), time.process_time()
        await engine.send_multipart([identity, message])
        while received[0] < target:
            await asyncio.sleep(0)
        wall.append(time.perf_counter() - start_wall)
        cpu.append(time.process_time() - start_cpu)
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await llm.pool.close()
    engine.close(linger=0)
    ctx.term()
    wall, cpu = sorted(wall[steps // 5:]), cpu[steps // 5:]
    return {"wall_ms": 1e3 * wall[len(wall) // 2], "cpu_ms": 1e3 * sum(cpu) / len(cpu)}


async def _added_ids(engine, num_streams: int, ipc) -> list[str]:
    """The engine ids of the first `num_streams` AddRequests (pings in between ignored)."""
    ids = []
    while len(ids) < num_streams:
        _, raw = await engine.recv_multipart()
        msg = ipc.EngineRequest.FromString(raw)
        if msg.WhichOneof("kind") == "add":
            ids.append(msg.add.request_id)
    return ids


def _run_in(tree: Path, args: argparse.Namespace, tokenizer: str) -> dict:
    """One run in a fresh process that imports the frontend of `tree`."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--measure-only", "--tokenizer", tokenizer,
           "--num-streams", str(args.num_streams), "--steps", str(args.steps)]
    out = subprocess.run(cmd, cwd=tree, env={**os.environ, "PYTHONPATH": str(tree)}, check=True,
                         capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def run(args: argparse.Namespace) -> int:
    if args.measure_only:
        import uvloop
        print(json.dumps(uvloop.run(measure(args.tokenizer, args.num_streams, args.steps))))
        return 0
    from bench.random_model import random_model_dir
    from bench.reporting import RESULTS_DIR, Worktree, machine_info, print_table, write_result
    tokenizer = str(random_model_dir("tiny", "float32"))  # the bundled SmolLM2 tokenizer
    root = Path(__file__).resolve().parent.parent
    head = subprocess.check_output(["git", "-C", str(root), "rev-parse", "HEAD"], text=True).strip()
    worktree = Worktree(args.baseline) if args.baseline else None
    runs: dict[str, list[dict]] = {"baseline": [], "current": []} if worktree else {"current": []}
    try:
        for _ in range(args.repeats):
            if worktree:
                runs["baseline"].append(_run_in(worktree.tree, args, tokenizer))
            runs["current"].append(_run_in(root, args, tokenizer))
    finally:
        if worktree:
            worktree.close()
    commits = {"baseline": worktree.sha if worktree else None, "current": head}
    results = {name: {**min(r, key=lambda x: x["wall_ms"]), "runs": r, "commit": commits[name]}
               for name, r in runs.items()}
    print_table(["build", "commit", "wall ms/step", "cpu ms/step"],
                [[n, r["commit"][:10], f"{r['wall_ms']:.2f}", f"{r['cpu_ms']:.2f}"] for n, r in results.items()])
    ratio = {"wall_ratio": results["current"]["wall_ms"] / results["baseline"]["wall_ms"]} if worktree else {}
    if ratio:
        print(f"frontend time per step: {ratio['wall_ratio']:.3f}x the baseline's")
    payload = {"machine": machine_info(), "workload": {"num_streams": args.num_streams, "steps": args.steps},
               "results": results, **ratio}
    path = write_result("frontend-step", payload, Path(args.output_dir) if args.output_dir else RESULTS_DIR)
    print(f"wrote {path}")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return run(parser.parse_args())


if __name__ == "__main__":
    sys.exit(main())
