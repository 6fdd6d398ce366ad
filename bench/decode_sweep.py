"""GQA decode plan sweep on a GPU: heads per CTA x split-K partition length.

    python -m bench.decode_sweep --output bench/results/decode-sweep-STAMP.json

GQA 8:1 (32 query heads, 4 KV heads), head 128, bf16, block 16, at batch 1..256 and
context 1k/4k. Each plan's time comes from CUDA-graph replays over input sets larger than
4x L2; `pct` is (K + V + q + out bytes) / time as a share of the device-to-device copy.
It is the measurement behind cupy_kernels.ops.PARTITION_CHOICES and plan_decode.
"""

from __future__ import annotations

import argparse
import json
import math


def sweep() -> dict:
    import torch
    from bench.kernels import graph_of, time_ms
    from cupy_kernels import ops
    props = torch.cuda.get_device_properties(0)
    x = torch.empty(2**28, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    copy_gbs = 2 * x.numel() / time_ms(lambda: y.copy_(x), 20) / 1e6
    D, BS, QH, KVH = 128, 16, 32, 4
    rows = []
    for batch in (1, 4, 16, 64, 256):
        for ctx in (1024, 4096):
            blocks = ctx // BS
            kv_bytes = 2 * batch * KVH * ctx * D * 2
            sets = max(1, math.ceil(4 * props.L2_cache_size / kv_bytes))
            num_blocks = sets * batch * blocks
            cache = torch.randn((2, KVH, num_blocks, BS, D), device="cuda").to(torch.bfloat16)
            tables = torch.randperm(num_blocks, device="cuda").to(torch.int32).view(sets, batch, blocks)
            lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
            qs = torch.randn((sets, batch, QH, D), device="cuda").to(torch.bfloat16)
            outs = torch.empty_like(qs)
            for heads_per_cta in (8, 4, 2):
                for tokens in (0, *ops.PARTITION_CHOICES):  # 0: single pass
                    if tokens >= ctx:
                        continue
                    plan = ops.DecodePlan(heads_per_cta, 8 // heads_per_cta,
                                          math.ceil(ctx / tokens) if tokens else 1, tokens or ops.PARTITION_TOKENS)
                    ws = torch.empty(max(1, ops.decode_workspace_numel(batch, QH, D, plan)), device="cuda")
                    calls = [lambda s=s: ops.decode_attention(outs[s], qs[s], cache, tables[s], lens, D ** -0.5,
                                                              plan, ws) for s in range(sets)]
                    us = time_ms(graph_of(calls).replay, 20) * 1000 / sets
                    pct = 100 * (kv_bytes + 4 * batch * QH * D) / us / 1e3 / copy_gbs
                    rows.append(dict(batch=batch, context=ctx, heads_per_cta=heads_per_cta,
                                     partition_tokens=tokens, us=us, pct=pct))
                    print(f"batch {batch:4d} context {ctx:5d} heads/CTA {heads_per_cta} partition {tokens:5d}"
                          f" {us:9.1f} us {pct:5.1f} %", flush=True)
            del cache, qs, outs
    return dict(copy_gb_s=copy_gbs, device=torch.cuda.get_device_name(), rows=rows)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--output", required=True, help="JSON file to write")
    args = p.parse_args()
    from bench.reporting import machine_info
    json.dump({"benchmark": "decode_sweep", "machine": machine_info("cuda"), "results": sweep()},
              open(args.output, "w"), indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
