"""`pagedserve bench tp`: tensor-parallel sizes against size 1, in-process, on the same prompts.

Each (size, collectives) run is its own spawned process (one tensor-parallel group per
process): it builds the offline `LLM` with the engine flags and that size, warms up, then
times one `generate` of --num-prompts random prompts, greedy, eos ignored. `--collectives`
runs CPU ranks with the shared-memory collectives (`shm`, the default path) and/or with gloo
alone (`gloo`, PAGEDSERVE_TP_SHM=0), which is what shared memory saves. Reports ms per
decode step (wall time over output tokens per prompt), output tok/s, the slowdown against size
1, and how many replies equal size 1's token for token (bfloat16 sums partial products in
another order, so near-ties may differ; float32 should match). Writes tp-<stamp>.json.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import time

from bench.offline import random_prompts
from bench.reporting import machine_info, print_table, write_result
from engine.arg_utils import add_engine_args, engine_config_from_args

SHM_ENV = "PAGEDSERVE_TP_SHM"  # "0": CPU ranks use gloo for every collective (engine/distributed/workers.py)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sizes", default="1,2", metavar="N[,N]",
                   help="tensor-parallel sizes; the first is the baseline (default: 1,2)")
    p.add_argument("--collectives", default="shm,gloo", metavar="NAME[,NAME]",
                   help="CPU ranks' collectives for sizes above 1: shm (shared memory, then gloo for "
                        "what does not fit) and/or gloo (gloo only) (default: shm,gloo)")
    p.add_argument("--num-prompts", type=int, default=4, help="prompts, generated together (default: 4)")
    p.add_argument("--input-len", type=int, default=64, help="prompt tokens (default: 64)")
    p.add_argument("--output-len", type=int, default=32, help="output tokens per prompt (default: 32)")
    p.add_argument("--output-dir", default=None, help="where to write JSON (default: bench/results)")
    add_engine_args(p, dtype="auto")


def run(args: argparse.Namespace) -> int:
    sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
    collectives = [c.strip() for c in args.collectives.split(",") if c.strip()]
    if not sizes or min(sizes) < 1 or set(collectives) - {"shm", "gloo"} or not collectives:
        raise SystemExit("bench tp: --sizes is a comma list of sizes >= 1, --collectives of shm and gloo")
    config = engine_config_from_args(args)
    ctx = multiprocessing.get_context("spawn")
    runs = []
    for size in sizes:
        for comm in (collectives if size > 1 else ["-"]):
            print(f"== tensor_parallel_size {size}, collectives {comm}", flush=True)
            runs.append({"size": size, "collectives": comm,
                         **_in_child(ctx, config, size, comm, args.num_prompts, args.input_len, args.output_len)})
    base = runs[0]
    rows = []
    for r in runs:
        r["slowdown"] = r["ms_per_step"] / base["ms_per_step"]
        r["same_as_first"] = sum(a == b for a, b in zip(r["token_ids"], base["token_ids"]))
        rows.append([r["size"], r["collectives"], r["seconds"], r["ms_per_step"], r["out_tok_s"], r["slowdown"],
                     f"{r['same_as_first']} / {args.num_prompts}"])
    print()
    print_table(["size", "collectives", "s", "ms / step", "out tok/s", "vs first", "same tokens"], rows)
    path = write_result("tp", {"machine": machine_info(config.device), "engine_config": vars(config),
                               "workload": {"num_prompts": args.num_prompts, "input_len": args.input_len,
                                            "output_len": args.output_len}, "runs": runs}, args.output_dir)
    print(f"wrote {path}")
    return 0


def _in_child(ctx, *args) -> dict:
    """_timed in a fresh (non-daemonic: it spawns the workers) process: one process group each."""
    results = ctx.Queue()
    child = ctx.Process(target=_timed, args=(results, *args))
    child.start()
    result = results.get()
    child.join()
    if isinstance(result, str):
        raise SystemExit(f"bench tp: the run failed:\n{result}")
    return result


def _timed(results, *args) -> None:
    try:
        results.put(_time_generate(*args))
    except BaseException:  # noqa: BLE001 - reported by the parent
        import traceback
        results.put(traceback.format_exc())


def _time_generate(config, size: int, comm: str, num_prompts: int, input_len: int, output_len: int) -> dict:
    from dataclasses import replace

    import torch

    from pagedserve import LLM, SamplingParams
    torch.set_flush_denormal(True)
    if comm == "gloo":
        os.environ[SHM_ENV] = "0"  # read when the workers are made, below
    llm = LLM(**vars(replace(config, tensor_parallel_size=size)))
    try:
        vocab = llm.engine.model_runner.arch.vocab_size
        prompts = random_prompts(num_prompts, input_len, vocab, seed=0)
        llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=4))
        params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
        start = time.perf_counter()
        outs = llm.generate(prompts, params)
        seconds = time.perf_counter() - start
    finally:
        llm.engine.model_runner.close()
    return {"seconds": seconds, "ms_per_step": 1000 * seconds / output_len,
            "out_tok_s": num_prompts * output_len / seconds,
            "token_ids": [list(o.outputs[0].token_ids) for o in outs]}
