"""`pagedserve bench kernels`: the paged-attention kernels against the HBM limit.

1. Copy bandwidth: a large device-to-device copy, bytes read + written over time.
2. Decode attention: achieved bandwidth = (K + V actually read + q + out) / time, at
   batch 1..256 and context 128..8192, MHA (32 kv heads) and GQA 8:1 (4 kv heads),
   head 128, bf16, block 16; both the single-pass and split-K kernels, the heuristic's
   choice marked. `--kv-cache-dtype fp8`: the same over an fp8 cache (one byte a value;
   q and out stay bf16), whose bytes are what "achieved" counts. Calls are captured in a
   CUDA graph and replayed (no Python launch gaps), rotating over input sets larger than L2
   so that no call reads from cache.
3. Fixed cost per call: the GPU time of a tiny decode (graph replays), and the host
   time of one launch passing data_ptr integers, __cuda_array_interface__ or DLPack.

Medians of CUDA-event timings. Prints a table; writes JSON (+ PNG) to bench/results.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time

from bench.reporting import machine_info, print_table, write_result

BATCHES = (1, 4, 16, 64, 128, 256)
CONTEXTS = (128, 512, 1024, 2048, 4096, 8192)
HEADS = {"MHA": (32, 32), "GQA8": (32, 4)}  # (query heads, kv heads)
HEAD_SIZE, BLOCK_SIZE = 128, 16


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--batches", default=",".join(map(str, BATCHES)), help="comma-separated batch sizes")
    p.add_argument("--contexts", default=",".join(map(str, CONTEXTS)), help="comma-separated context lengths")
    p.add_argument("--pool-gb", type=float, default=16.0,
                   help="most GiB of KV cache to allocate; larger cases are skipped (default: 16)")
    p.add_argument("--replays", type=int, default=7, help="timed graph replays per case (default: 7)")
    p.add_argument("--output-dir", default=None, help="where to write JSON and PNG (default: bench/results)")
    p.add_argument("--kv-cache-dtype", choices=["auto", "fp8"], default="auto",
                   help="the decode cases' cache: auto (bf16, as q) or fp8 (e4m3; default: auto)")


def run(args: argparse.Namespace) -> int:
    import cupy_kernels
    if not cupy_kernels.available():
        print(f"error: bench kernels needs a CUDA GPU with cupy: {cupy_kernels.unavailable_reason()}",
              file=sys.stderr)
        return 1
    import torch
    from tqdm import tqdm
    torch.manual_seed(0)
    props = torch.cuda.get_device_properties(0)
    copy_gbs = copy_bandwidth()
    batches, contexts = _ints(args.batches), _ints(args.contexts)
    cases = [(name, b, L) for name in HEADS for b in batches for L in contexts]
    rows = []
    for name, batch, context in tqdm(cases, desc="decode cases", unit="case"):
        rows.append(decode_case(name, batch, context, props, args.pool_gb, args.replays, copy_gbs,
                                args.kv_cache_dtype))
    results = {"copy_gb_s": copy_gbs, "decode": rows, "fixed_cost": fixed_costs(), "num_sms": props.multi_processor_count,
               "l2_mb": props.L2_cache_size / 2**20}
    results["kv_cache_dtype"] = args.kv_cache_dtype
    report(results)
    path = write_result("kernels", {"machine": machine_info("cuda"), "results": results}, args.output_dir)
    from bench.plots import plot_kernels
    cache = "bf16" if args.kv_cache_dtype == "auto" else "bf16 over an fp8 cache"
    chart = plot_kernels(rows, f"decode attention, {props.name}, {cache}, head {HEAD_SIZE}", path.with_suffix(".png"))
    print(f"\nwrote {path} and {chart.name}")
    return 0


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def time_ms(fn, repeats: int) -> float:
    """Median milliseconds of fn() over `repeats` CUDA-event timings, after one warm-up."""
    import torch
    fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def copy_bandwidth(gib: float = 2.0) -> float:
    """GB/s of a device-to-device copy, counting bytes read plus bytes written."""
    import torch
    n = int(gib * 2**30)
    src, dst = torch.empty(n, dtype=torch.uint8, device="cuda"), torch.empty(n, dtype=torch.uint8, device="cuda")
    src.random_(0, 255)
    ms = time_ms(lambda: dst.copy_(src), 10)
    del src, dst
    return 2 * n / ms / 1e6


def graph_of(calls) -> object:
    """A CUDA graph of the given launch closures, run in order (after one eager warm-up)."""
    import torch
    for call in calls:
        call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    return graph


def decode_case(name: str, batch: int, context: int, props, pool_gb: float, replays: int, copy_gbs: float,
                kv_cache_dtype: str = "auto") -> dict:
    """The decode kernel single pass and split-K, and the tensor-core one under its plan, on one
    shape; per-call time from graph replays over rotated inputs."""
    import torch
    from cupy_kernels import ops
    num_q_heads, num_kv_heads = HEADS[name]
    elem = 2  # bf16: q, out
    kv_elem = 1 if kv_cache_dtype == "fp8" else elem
    blocks_per_seq = math.ceil(context / BLOCK_SIZE)
    kv_bytes = 2 * batch * num_kv_heads * context * HEAD_SIZE * kv_elem
    moved = kv_bytes + 2 * batch * num_q_heads * HEAD_SIZE * elem  # + q + out
    block_bytes = 2 * num_kv_heads * BLOCK_SIZE * HEAD_SIZE * kv_elem
    sets = max(1, math.ceil(4 * props.L2_cache_size / kv_bytes))  # calls per graph: > 4x L2 in all
    if sets * batch * blocks_per_seq * block_bytes > pool_gb * 2**30:
        sets = int(pool_gb * 2**30 // (batch * blocks_per_seq * block_bytes))
    row = {"heads": name, "batch": batch, "context": context, "bytes": moved}
    if sets == 0:
        return {**row, "skipped": f"needs more than --pool-gb {pool_gb}"}
    num_blocks = sets * batch * blocks_per_seq
    cache = torch.empty((2, num_kv_heads, num_blocks, BLOCK_SIZE, HEAD_SIZE), dtype=torch.bfloat16, device="cuda")
    cache.normal_()
    if kv_cache_dtype == "fp8":
        cache = cache.to(torch.float8_e4m3fn)
    perm = torch.randperm(num_blocks, device="cuda").to(torch.int32).view(sets, batch, blocks_per_seq)
    lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    qs = torch.randn((sets, batch, num_q_heads, HEAD_SIZE), device="cuda").to(torch.bfloat16)
    outs = torch.empty_like(qs)
    heuristic = ops.plan_decode(batch, num_kv_heads, num_q_heads // num_kv_heads, context, props.multi_processor_count)
    plans = {"single": ops.DecodePlan(heuristic.heads_per_cta, heuristic.num_chunks, 1)}
    if heuristic.split:
        plans["split"] = heuristic
    elif context > ops.PARTITION_TOKENS:  # what splitting would have given
        plans["split"] = ops.DecodePlan(heuristic.heads_per_cta, heuristic.num_chunks,
                                        math.ceil(context / ops.PARTITION_TOKENS))
    # The tensor-core kernel (decode_mma.cu) under its own heuristic plan.
    group = num_q_heads // num_kv_heads
    plans["mma"] = ops.plan_decode(batch, num_kv_heads, group, context, props.multi_processor_count, True)
    workspace = torch.empty(max(ops.decode_workspace_numel(batch, num_q_heads, HEAD_SIZE, p) for p in plans.values())
                            or 1, device="cuda")
    for kind, plan in plans.items():
        calls = [lambda s=s, plan=plan: ops.decode_attention(outs[s], qs[s], cache, perm[s], lens, HEAD_SIZE ** -0.5,
                                                             plan, workspace) for s in range(sets)]
        graph = graph_of(calls)
        us = time_ms(graph.replay, replays) * 1000 / sets
        row[f"{kind}_us"] = us
        row[f"{kind}_pct"] = 100 * moved / us / 1e3 / copy_gbs
    row["heuristic"] = "split" if heuristic.split else "single"
    if "split" in plans:
        row["split_partition_tokens"] = plans["split"].partition_tokens
    row["pct"] = row[f"{row['heuristic']}_pct"]  # the default kernel (decode.cu); mma_pct: decode_mma.cu
    del cache, qs, outs, workspace
    return row


def fixed_costs() -> dict:
    """Tiny decode (1 sequence, 1 kv head, 16 tokens): GPU time per call, and host time per
    launch for three ways of handing tensors to cupy. fp16: cupy has no bfloat16 dtype to
    wrap a tensor as."""
    import cupy
    import numpy as np
    import torch
    from cupy_kernels import compile as kc, ops
    cache = torch.randn((2, 1, 4, BLOCK_SIZE, HEAD_SIZE), device="cuda").to(torch.float16)
    table = torch.tensor([[2]], dtype=torch.int32, device="cuda")
    lens = torch.tensor([16], dtype=torch.int32, device="cuda")
    q = torch.randn((1, 1, HEAD_SIZE), device="cuda").to(torch.float16)
    out = torch.empty_like(q)
    plan = ops.DecodePlan(1, 1, 1)

    def via_ptr():
        ops.decode_attention(out, q, cache, table, lens, 0.1, plan)

    graph = graph_of([via_ptr] * 100)
    gpu_us = time_ms(graph.replay, 7) * 10  # 100 calls per replay -> us per call
    kernel = kc.get_kernel("decode", kc.decode_expr("float16", HEAD_SIZE, BLOCK_SIZE, 1, False), 0)
    scalars = (np.int64(HEAD_SIZE), np.int32(1), np.int32(4), np.int32(1), np.int32(1), np.int32(512), np.float32(0.1))

    def launcher(wrap):
        def launch():
            v = np.uint64(cache.data_ptr() + cache[0].numel() * 2)
            args = (wrap(out), np.uint64(0), np.uint64(0), np.uint64(0), wrap(q), scalars[0], wrap(cache), v,
                    wrap(table), scalars[1], wrap(lens), *scalars[2:])
            kernel.kernel((1, 1, 1), (ops.THREADS,), args, 0, ops._stream())
        return launch

    host = {"data_ptr": host_us(via_ptr), "data_ptr_raw": host_us(launcher(lambda t: np.uint64(t.data_ptr()))),
            "cuda_array_interface": host_us(launcher(cupy.asarray)), "dlpack": host_us(launcher(cupy.from_dlpack))}
    return {"gpu_us_per_call": gpu_us, "host_us_per_launch": host}


def host_us(launch, n: int = 2000) -> float:
    """Host microseconds per launch, median of 5 runs of n launches (GPU work not waited on)."""
    import torch
    runs = []
    for _ in range(6):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(n):
            launch()
        runs.append((time.perf_counter() - start) / n * 1e6)
    torch.cuda.synchronize()
    return statistics.median(runs[1:])


def report(results: dict) -> None:
    print(f"\ncopy bandwidth: {results['copy_gb_s']:,.0f} GB/s (read + write)")
    fixed = results["fixed_cost"]
    print(f"fixed cost: {fixed['gpu_us_per_call']:.2f} us GPU per tiny decode call; host per launch: "
          + ", ".join(f"{k} {v:.1f} us" for k, v in fixed["host_us_per_launch"].items()))
    rows = [[r["heads"], r["batch"], r["context"], r.get("single_us", "-"), r.get("single_pct", "-"),
             r.get("split_us", "-"), r.get("split_pct", "-"), r.get("heuristic", r.get("skipped", "")),
             r.get("mma_us", "-"), r.get("mma_pct", "-")]
            for r in results["decode"]]
    print()
    print_table(["heads", "batch", "context", "single us", "single %", "split us", "split %", "chosen",
                 "mma us", "mma %"], rows)


if __name__ == "__main__":  # python -m bench.kernels: no CLI imports (the GPU session uses it)
    _parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_arguments(_parser)
    sys.exit(run(_parser.parse_args()))
