"""gpt-oss on CPU: MXFP4 experts kept as fp4 blocks (the exact bf16 kernels), the same in
`--cpu-arithmetic int8` (8-bit activations, integer dot products) and the same checkpoint
with its experts dequantized to bf16, in one run (`python -m bench.gpt_oss`).

The model: gpt-oss-20b's shape (hidden 2880, 32 experts of width 2880, top 4, 64 query and 8
kv heads of 64, alternating 128-token windows, YaRN) with random weights, --layers of its 24
layers (what this machine's memory holds) and the vocabulary cut to the bundled tokenizer's
49,152 rows; the experts written as OpenAI ships them (`*_blocks`, `*_scales`), random codes
and scales 2^-8..2^-4; everything else bf16. Made once, cached under ~/.cache/pagedserve.

Per variant: the RSS a load adds (a process of its own), one stream's time per output token,
and --batch streams' output tok/s (--input-len in, --output-len out). Writes JSON and a chart
to bench/results/ and prints a table; the issue's memory target is the fp4 load's RSS within
1.15x of the checkpoint's size (int8's layout is the checkpoint's 4.25 bits a weight).
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import torch

from bench.reporting import load_rss, machine_info, model_bytes, median, name_plot, print_table, write_result

SHAPE = dict(hidden_size=2880, intermediate_size=2880, num_local_experts=32, num_experts_per_tok=4,
             num_attention_heads=64, num_key_value_heads=8, head_dim=64, sliding_window=128, vocab_size=49152)
RSS_TO_FILE = 1.15
FP4, INT8, DENSE = "MXFP4 as fp4 blocks", "MXFP4, --cpu-arithmetic int8", "dequantized bf16 experts"
# The baseline's loading path: MXFP4 experts dequantized to bf16 instead of kept as fp4.
DENSE_EXPERTS = "from engine.models.gpt_oss import GptOssForCausalLM\nGptOssForCausalLM._keep_fp4 = lambda *a: False"


def build(layers: int) -> Path:
    """The random MXFP4 checkpoint (cached by layer count)."""
    from safetensors.torch import save_file
    from transformers import GptOssConfig

    from common.paths import cache_dir
    from engine.models.loader import load_tokenizer
    from engine.models.source import bundled_model_path
    folder = cache_dir() / "bench-gpt-oss" / f"gpt-oss-20b-shape-{layers}-layers"
    if (folder / "config.json").is_file():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    config = GptOssConfig(num_hidden_layers=layers, tie_word_embeddings=False, **SHAPE)
    config.architectures = ["GptOssForCausalLM"]  # as OpenAI's config.json names it (llama.cpp's converter reads it)
    config.quantization_config = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    g = torch.Generator().manual_seed(0)
    h, e, i, d = config.hidden_size, config.num_local_experts, config.intermediate_size, config.head_dim
    q, kv = config.num_attention_heads * d, config.num_key_value_heads * d

    def dense(*shape, std=0.02):
        return (torch.randn(*shape, generator=g) * std).bfloat16()

    def mxfp4(rows, cols):
        blocks = torch.randint(0, 256, (e, rows, cols // 32, 16), dtype=torch.uint8, generator=g)
        return blocks, torch.randint(127 - 8, 127 - 3, (e, rows, cols // 32), dtype=torch.uint8, generator=g)

    tensors = {"model.embed_tokens.weight": dense(config.vocab_size, h), "lm_head.weight": dense(config.vocab_size, h),
               "model.norm.weight": torch.ones(h).bfloat16()}
    for layer in range(layers):
        p = f"model.layers.{layer}."
        for name, rows, cols in (("q_proj", q, h), ("k_proj", kv, h), ("v_proj", kv, h), ("o_proj", h, q)):
            tensors[f"{p}self_attn.{name}.weight"] = dense(rows, cols)
            tensors[f"{p}self_attn.{name}.bias"] = dense(rows)
        tensors[f"{p}self_attn.sinks"] = dense(config.num_attention_heads, std=1.0)
        tensors[f"{p}mlp.router.weight"], tensors[f"{p}mlp.router.bias"] = dense(e, h), dense(e)
        for name, rows, cols in (("gate_up_proj", 2 * i, h), ("down_proj", h, i)):
            blocks, scales = mxfp4(rows, cols)
            tensors[f"{p}mlp.experts.{name}_blocks"], tensors[f"{p}mlp.experts.{name}_scales"] = blocks, scales
            tensors[f"{p}mlp.experts.{name}_bias"] = dense(e, rows)
        for norm in ("input_layernorm", "post_attention_layernorm"):
            tensors[f"{p}{norm}.weight"] = torch.ones(h).bfloat16()
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"))
    config.save_pretrained(str(folder))
    load_tokenizer(bundled_model_path()).save_pretrained(str(folder))
    return folder


def measure(folder: Path, variant: str, args: argparse.Namespace) -> dict:
    from bench.offline import time_engine_single
    from engine.models.gpt_oss import GptOssForCausalLM
    from pagedserve import LLM, SamplingParams
    dense = variant == DENSE
    options = {"dtype": "bfloat16", "cpu_arithmetic": "int8" if variant == INT8 else "auto"}
    keep = GptOssForCausalLM._keep_fp4
    if dense:
        GptOssForCausalLM._keep_fp4 = lambda *a: False
    try:
        llm = LLM(str(folder), enable_prefix_caching=False, num_threads=args.num_threads, **options)
    finally:
        GptOssForCausalLM._keep_fp4 = keep
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 49152) for _ in range(args.input_len)] for _ in range(args.batch)]
    rss = load_rss(str(folder), options, DENSE_EXPERTS if dense else "")
    out = {"rss_mib": round(rss / 2**20, 1)}
    out["tpot_ms"] = 1e3 / time_engine_single(llm, prompts[0], args.output_len, args.repeats)["decode_tok_s"]
    greedy = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    times = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        llm.generate(prompts, greedy)
        times.append(time.perf_counter() - start)
    out["batch_output_tok_s"] = args.batch * args.output_len / median(times)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.gpt_oss", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=2, help="layers of gpt-oss-20b's 24 (default: 2)")
    p.add_argument("--input-len", type=int, default=128, help="prompt tokens (default: 128)")
    p.add_argument("--output-len", type=int, default=32, help="output tokens per stream (default: 32)")
    p.add_argument("--batch", type=int, default=32, help="streams at once (default: 32)")
    p.add_argument("--repeats", type=int, default=2, help="timed runs (default: 2)")
    p.add_argument("--num-threads", type=int, default=None, help="CPU threads (default: all cores)")
    p.add_argument("--output-dir", default=None, help="where to write JSON (default: bench/results)")
    args = p.parse_args(argv)
    folder = build(args.layers)
    file_mib = model_bytes(folder) / 2**20
    results = {name: measure(folder, name, args) for name in (FP4, INT8, DENSE)}
    fp4, int8, dense = results[FP4], results[INT8], results[DENSE]
    ratios = {"rss_to_file": fp4["rss_mib"] / file_mib, "tpot_speedup": dense["tpot_ms"] / fp4["tpot_ms"],
              "batch_speedup": fp4["batch_output_tok_s"] / dense["batch_output_tok_s"],
              "int8_rss_to_file": int8["rss_mib"] / file_mib, "int8_tpot_speedup": fp4["tpot_ms"] / int8["tpot_ms"],
              "int8_batch_speedup": int8["batch_output_tok_s"] / fp4["batch_output_tok_s"]}
    rows = [[n, r["rss_mib"], f"{r['tpot_ms']:.1f}", f"{r['batch_output_tok_s']:.1f}"] for n, r in results.items()]
    print_table(["experts", "RSS MiB", "TPOT ms (1 stream)", f"tok/s ({args.batch} streams)"], rows)
    print(f"checkpoint {file_mib:.1f} MiB; fp4 RSS / file {ratios['rss_to_file']:.3f} (target <= {RSS_TO_FILE}); "
          f"fp4 vs dequantized: TPOT {ratios['tpot_speedup']:.2f}x, batch {ratios['batch_speedup']:.2f}x; "
          f"int8 vs fp4: TPOT {ratios['int8_tpot_speedup']:.2f}x, batch {ratios['int8_batch_speedup']:.2f}x, "
          f"RSS / file {ratios['int8_rss_to_file']:.3f}")
    path = write_result("gpt-oss-cpu", {
        "machine": machine_info("cpu"),
        "model": {"shape": SHAPE, "layers": args.layers, "file_mib": round(file_mib, 1)},
        "workload": {k: getattr(args, k) for k in ("input_len", "output_len", "batch", "repeats", "num_threads")},
        "results": results, "ratios": ratios, "rss_target": RSS_TO_FILE}, args.output_dir)
    print(f"wrote {path} and {plot(path).name}")
    return 0


def plot(path: Path) -> Path:
    """The result file's three measures, a bar per variant, as a .png beside it (named in it)."""
    import json

    from bench.plots import plot_panels
    payload = json.loads(path.read_text())
    title = (f"gpt-oss-20b shape, {payload['model']['layers']} layers, {payload['machine']['cpu']}, "
             f"checkpoint {payload['model']['file_mib']:,.0f} MiB")
    chart = plot_panels(payload["results"], [("rss_mib", "RSS of the load, MiB"),
                                             ("tpot_ms", "TPOT ms, 1 stream (lower is better)"),
                                             ("batch_output_tok_s", "output tok/s, batch")],
                        title, path.with_suffix(".png"))
    return name_plot(path, chart)


if __name__ == "__main__":
    sys.exit(main())
