"""`python -m bench.cpu_linear`: the quantized linear kernels against dense oneDNN GEMMs.

For each of SmolLM2-135M's linear shapes (qkv, o, gate_up, down; N x K) and each row count
M, one call of:
  - int4 bf16: the bf16 kernel (cpu_kernels/csrc/quant_linear_bf16.cpp), packed Q4_1-style
    weights, bfloat16 activations (where the CPU has AVX512-BF16);
  - int4 amx: the same kernel in AMX arithmetic, tiles from 16 rows on (where the CPU has AMX);
  - int4 fp32: the float32-activation kernel (csrc/quant_linear.cpp), row layout;
  - dense bf16 and dense fp32: torch's matmul (oneDNN / MKL) on dense weights.
Calls rotate over enough copies of the weights to exceed the CPU's caches, as the engine's
layers do, and the methods alternate. Medians; prints a table and writes JSON (with the
CPU's flags) to bench/results.
"""

from __future__ import annotations

import argparse
import sys
import time

from bench.reporting import machine_info, median, print_table, write_result

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}
ROWS = (1, 8, 32, 512, 2048)
ROTATE_BYTES = 96 << 20  # rotate over at least this much weight memory: past any L3


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rows", default=",".join(map(str, ROWS)), help="comma-separated row counts M")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    p.add_argument("--seconds", type=float, default=0.3, help="timing budget per case and method")
    p.add_argument("--output-dir", default=None, help="where to write JSON (default: bench/results)")


def run(args: argparse.Namespace) -> int:
    import torch

    import cpu_kernels
    from cpu_kernels import ops
    if not cpu_kernels.available("quant_linear"):
        print(f"error: the quantized kernels did not build: {cpu_kernels.unavailable_reason('quant_linear')}",
              file=sys.stderr)
        return 1
    if args.threads:
        torch.set_num_threads(args.threads)
    bf16, amx = ops.bf16_dot_supported(), ops.bf16_amx_ready()
    rows = []
    for m in (int(x) for x in args.rows.split(",")):
        for name, (n, k) in SHAPES.items():
            rows.append(case(name, m, n, k, bf16, amx, args.seconds))
            print(f"  {name} M={m}: " + ", ".join(f"{key} {rows[-1][key]}" for key in rows[-1] if key.endswith("us")),
                  file=sys.stderr)
    columns = ["int4_amx_us", "int4_bf16_us", "int4_fp32_us", "dense_bf16_us", "dense_fp32_us"]
    print_table(["layer", "M", *columns, "best int4 GFLOPS", "vs dense bf16"],
                [[r["layer"], r["m"], *[r.get(c, "-") for c in columns], r.get("int4_gflops", "-"),
                  r.get("int4_vs_dense_bf16", "-")] for r in rows])
    path = write_result("cpu-linear", {"machine": machine_info("cpu"), "threads": torch.get_num_threads(),
                                       "bf16_kernels": bf16, "amx": amx, "results": rows}, args.output_dir)
    print(f"\nwrote {path}")
    return 0


def case(name: str, m: int, n: int, k: int, bf16: bool, amx: bool, seconds: float) -> dict:
    import torch

    from cpu_kernels import ops, packing
    from engine.layers.quantized import quantize
    base = [quantize(torch.randn(n, k) * 0.05, "int4") for _ in range(4)]

    def rotation(make, bytes_each: int) -> list:
        """Distinct copies (clones), enough to exceed the caches."""
        count = max(2, ROTATE_BYTES // bytes_each)
        return [make(base[i % len(base)]) for i in range(count)]

    def clone(q):
        return q.map_rows(lambda t: t.clone())

    x = torch.randn(m, k)
    xb = x.bfloat16()
    methods = {
        "int4_fp32_us": (rotation(clone, n * k * 3 // 4), lambda w: ops.int4_linear(x, w.qweight, w.scales, w.zeros)),
        "dense_fp32_us": (rotation(lambda q: q.dequantize(), n * k * 4), lambda w: x @ w.t()),
        "dense_bf16_us": (rotation(lambda q: q.dequantize().bfloat16(), n * k * 2), lambda w: xb @ w.t()),
    }
    if bf16:
        methods["int4_bf16_us"] = (rotation(packing.pack, n * k * 5 // 8),
                                   lambda w: ops.bf16_quant_linear(xb, "int4", w.data, n))
    if amx:
        methods["int4_amx_us"] = (methods["int4_bf16_us"][0],
                                  lambda w: ops.bf16_quant_linear(xb, "int4", w.data, n, amx=True))
    times = {key: [] for key in methods}
    deadline = time.perf_counter() + seconds * len(methods)
    i = 0
    while time.perf_counter() < deadline or min(len(t) for t in times.values()) < 3:
        for key, (ws, call) in methods.items():
            start = time.perf_counter()
            call(ws[i % len(ws)])
            times[key].append(time.perf_counter() - start)
        i += 1
    out = {"layer": name, "m": m, "n": n, "k": k}
    for key, t in times.items():
        out[key] = round(median(t[1:]) * 1e6, 1)
    if bf16:
        best = min(out["int4_bf16_us"], out.get("int4_amx_us", float("inf")))
        out["int4_gflops"] = round(2 * m * n * k / best / 1e3, 1)
        out["int4_vs_dense_bf16"] = round(out["dense_bf16_us"] / best, 2)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
