"""`python -m bench.cpu_attention`: decode attention on CPU, torch backend against the kernel.

Per call, one layer: the torch backend's decode (index_select gather of every sequence's
blocks, padded to buckets, then batched matmuls; its per-step `prepare` is timed apart,
since all layers share it) against `cpu_kernels.ops.paged_decode`, which reads the blocks
in place. SmolLM2-135M's shapes by default: 9 query heads, 3 kv heads, head 64, block 16,
float32. Block tables are shuffled, and calls rotate over enough copies of the cache to
exceed the CPU's caches, as successive layers do in the engine.

`--window W` times a sliding-window layer instead (both paths read only the last W tokens).
`--kv-cache-dtype int8` times both paths on an int8 cache (engine/attention/kv_format.py: the
torch backend dequantizes what it gathers, the kernel in registers), and the kernel on the
--dtype cache too, in the same rotation: what the int8 rows cost or save against it.

Medians of wall-clock timings, the two paths' calls alternating. Prints a table; writes JSON to bench/results.
"""

from __future__ import annotations

import argparse
import math
import sys
import time

from bench.reporting import machine_info, median, print_table, write_result

BATCHES = (1, 8, 32, 64)
CONTEXTS = (256, 1024, 4096)
ROTATE_BYTES = 256 << 20  # rotate over at least this much KV cache: past any L3


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--batches", default=",".join(map(str, BATCHES)), help="comma-separated batch sizes")
    p.add_argument("--contexts", default=",".join(map(str, CONTEXTS)), help="comma-separated context lengths")
    p.add_argument("--heads", default="9,3", help="query heads,kv heads (default: 9,3)")
    p.add_argument("--head-dim", type=int, default=64, help="head size (default: 64)")
    p.add_argument("--block-size", type=int, default=16, help="KV block size (default: 16)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--window", type=int, default=None, help="sliding window in tokens (default: none)")
    p.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "int8"),
                   help="int8: an int8 cache, and the kernel on the --dtype cache beside it (default: auto)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's, all cores)")
    p.add_argument("--seconds", type=float, default=0.5, help="timing budget per case and method (default: 0.5)")
    p.add_argument("--output-dir", default=None, help="where to write JSON (default: bench/results)")


def run(args: argparse.Namespace) -> int:
    import torch

    import cpu_kernels
    from cpu_kernels import ops
    if not cpu_kernels.available("paged_attention"):
        print(f"error: the CPU attention kernel did not build: {cpu_kernels.unavailable_reason('paged_attention')}",
              file=sys.stderr)
        return 1
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.set_flush_denormal(True)
    heads = tuple(int(x) for x in args.heads.split(","))
    rows = []
    for context in _ints(args.contexts):
        for batch in _ints(args.batches):
            rows.append(case(batch, context, heads, args))
            r = rows[-1]
            print(f"  batch {batch:3d} context {context:5d}: torch {r['torch_us']:9.1f} us, "
                  f"kernel {r['kernel_us']:9.1f} us", file=sys.stderr)
    int8 = args.kv_cache_dtype == "int8"
    print_table(["batch", "context", "torch prepare us", "torch decode us", "kernel us", "speedup", "kernel GB/s"]
                + ([f"{args.dtype} kernel us", "int8 / it"] if int8 else []),
                [[r["batch"], r["context"], r["torch_prepare_us"], r["torch_us"], r["kernel_us"], r["speedup"],
                  r["kernel_gb_s"]] + ([r["unquantized_kernel_us"], r["kernel_us"] / r["unquantized_kernel_us"]]
                                       if int8 else []) for r in rows])
    config = {"heads": heads, "head_dim": args.head_dim, "block_size": args.block_size, "dtype": args.dtype,
              "kv_cache_dtype": args.kv_cache_dtype,
              "threads": torch.get_num_threads(), "window": args.window,
              # bfloat16's arithmetic in the kernel: VDPBF16PS (AVX512-BF16 builds) or AVX2 fp32
              "kernel_bf16_dot": ops.paged_decode_bf16_dot()}
    path = write_result("cpu-attention", {"machine": machine_info("cpu"), "config": config, "results": rows},
                        args.output_dir)
    print(f"\nwrote {path}")
    return 0


def case(batch: int, context: int, heads: tuple[int, int], args: argparse.Namespace) -> dict:
    import torch

    from cpu_kernels import ops
    from engine.attention import AttentionMetadata
    from engine.attention.kv_format import kv_cache_format
    from engine.attention.torch_backend import TorchAttentionBackend
    num_heads, num_kv_heads = heads
    dim, bs, dtype = args.head_dim, args.block_size, getattr(torch, args.dtype)
    fmt = kv_cache_format(args.kv_cache_dtype, dtype)
    blocks_per_seq = math.ceil(context / bs)
    num_blocks = batch * blocks_per_seq
    cache_bytes = 2 * num_kv_heads * num_blocks * bs * fmt.bytes_per_token_head(dim)
    copies = max(1, min(32, math.ceil(ROTATE_BYTES / cache_bytes)))
    floats = [torch.randn(2, num_kv_heads, num_blocks, bs, dim).to(dtype) for _ in range(copies)]
    caches = [fmt.quantize_rows(c) for c in floats] if fmt.quantized else floats
    tables = torch.randperm(num_blocks).view(batch, blocks_per_seq)  # no sequence's blocks in order
    lens = torch.full((batch,), context, dtype=torch.long)
    q = torch.randn(batch, num_heads, dim).to(dtype)
    scale = dim ** -0.5
    backend = TorchAttentionBackend(num_heads, num_kv_heads, dim, fmt)

    def meta():
        return AttentionMetadata(slot_mapping=torch.empty(0, dtype=torch.long), num_decode_tokens=batch,
                                 decode_block_tables=tables, decode_context_lens=lens,
                                 backend_state={"block_size": bs})
    def prepare(step):
        backend.prepare(step)
        return backend._decode_plan(step, args.window)  # the window's plan, once per step
    plan = prepare(meta())
    rotation = iter(range(1 << 62))
    fns = [lambda: backend._decode_with(q, caches[next(rotation) % copies], plan),
           lambda: ops.paged_decode(q, caches[next(rotation) % copies], tables, lens, scale, args.window)]
    if fmt.quantized:  # the same kernel on the unquantized cache, alternating with the others
        fns.append(lambda: ops.paged_decode(q, floats[next(rotation) % copies], tables, lens, scale, args.window))
    torch_us, kernel_us, *unquantized_us = time_us(fns, args.seconds)
    prepare_us, = time_us([lambda: prepare(meta())], args.seconds / 4)
    kv_bytes = 2 * batch * min(context, args.window or context) * num_kv_heads * fmt.bytes_per_token_head(dim)
    return {"batch": batch, "context": context, "torch_prepare_us": prepare_us, "torch_us": torch_us,
            "kernel_us": kernel_us, "speedup": torch_us / kernel_us, "kernel_gb_s": kv_bytes / kernel_us / 1e3,
            "cache_copies": copies} | ({"unquantized_kernel_us": unquantized_us[0]} if unquantized_us else {})


def time_us(fns: list, seconds: float) -> list[float]:
    """Median microseconds per call of each fn, after two warm-up calls each, within about
    `seconds` per fn. Calls alternate between the fns, so that a machine whose speed drifts
    (a shared VM) slows them alike."""
    for fn in fns:
        fn(), fn()
    times: list[list[float]] = [[] for _ in fns]
    deadline = time.perf_counter() + seconds * len(fns)
    while len(times[0]) < 5 or (time.perf_counter() < deadline and len(times[0]) < 2000):
        for fn, samples in zip(fns, times):
            start = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - start)
    return [median(samples) * 1e6 for samples in times]


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.cpu_attention", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
