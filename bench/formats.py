"""`pagedserve bench formats`: each weight format's speed beside its accuracy, in one run.

Formats of the bundled SmolLM2 (or --model, a GGUF), all of the same float weights:
  float32, bfloat16   the GGUF dequantized (`--quantization none`): dense weights; float32
                      is the reference
  int8, int4          that float checkpoint quantized at load (`--quantization int8|int4`);
                      its HF folder is exported once from the GGUF by transformers
  gguf                the GGUF's own blocks run as stored (Q4_1 layers, Q8_0 head)
  q4_0, q8_0          the GGUF's layers requantized by gguf-py, the head in F16
  gptq-int4, awq, w4a16, w8a16, fp8, fp8-block
                      the HF export quantized by the tools users run (bench/format_sources.py):
                      GPTQModel (gptq, group 64 on SmolLM2), AWQ's GEMM layout, llm-compressor's
                      compressed-tensors W4A16 / W8A16 (GPTQ) and FP8_DYNAMIC (per channel),
                      DeepSeek-V3's 128-style block FP8 (blocks of 64 on SmolLM2); heads in 16 bits
The quantized formats run in --dtype (default auto: what this machine's measured kernel
plan prefers, cpu_kernels/dispatch.py; printed first with the reasons, and kept in the JSON).
The checkpoints of the last group take minutes to make the first time (a side environment for
the tools, then their calibration), then come from the cache.

For each, in-process (`LLM`), with prefix caching off:
  - perplexity on bench/data/perplexity.txt (prompt logprobs), and its ratio to float32's;
  - one stream: time per output token after a --input-len prompt;
  - --batch streams at once: output tokens/s over --input-len in / --output-len out;
  - prefill: prompt tokens/s of one --prefill-len prompt;
  - memory: the process's RSS growth while the model loads (a 16-block KV cache and the
    tokenizer included), beside the size of its files.
Speeds are medians of --repeats runs, compared as ratios to float32 measured in the same run,
and the quantized checkpoints' targets as ratios to their baselines of the same run (GPTQ and
AWQ to q4_0, FP8 to bfloat16).
"""

from __future__ import annotations

import argparse
import math
import random
import time
from pathlib import Path

from tqdm import tqdm

from bench.hf_reference import hf_folder
from bench.offline import time_engine_single
from bench.plots import save_figure
from bench.reporting import load_rss, machine_info, model_bytes, median, print_table, write_result

FORMATS = {
    "float32": dict(dtype="float32", quantization="none"),
    "bfloat16": dict(dtype="bfloat16", quantization="none"),
    "int8": dict(quantization="int8", hf=True),
    "int4": dict(quantization="int4", hf=True),
    "gguf": dict(),
    "q4_0": dict(gguf="Q4_0"),
    "q8_0": dict(gguf="Q8_0"),
    "gptq-int4": dict(checkpoint="gptq"),
    "awq": dict(checkpoint="awq"),
    "w4a16": dict(checkpoint="ct-w4a16"),
    "w8a16": dict(checkpoint="ct-w8a16"),
    "fp8": dict(checkpoint="ct-fp8"),
    "fp8-block": dict(checkpoint="fp8-block"),
}
# The targets (46): (format, baseline, measure, at least).
TARGETS = [("gptq-int4", "q4_0", "tpot_speedup", 0.95), ("gptq-int4", "q4_0", "batch_speedup", 0.95),
           ("awq", "q4_0", "tpot_speedup", 0.95), ("awq", "q4_0", "batch_speedup", 0.95),
           ("fp8", "bfloat16", "tpot_speedup", 1.6), ("fp8", "bfloat16", "batch_speedup", 1.0)]
INT4_RSS_TO_FILE = 1.2  # a loaded int4 checkpoint's RSS growth to its files' size
INT4_CHECKPOINTS = ("gptq-int4", "awq", "w4a16")
TEXT = Path(__file__).resolve().parent / "data" / "perplexity.txt"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="a GGUF file (default: the bundled SmolLM2)")
    p.add_argument("--formats", default=",".join(FORMATS), type=_format_list,
                   help=f"comma-separated, from {', '.join(FORMATS)} (default: all)")
    p.add_argument("--input-len", type=int, default=128, help="prompt tokens (default: 128)")
    p.add_argument("--output-len", type=int, default=128, help="output tokens per stream (default: 128)")
    p.add_argument("--batch", type=int, default=32, help="streams at once (default: 32)")
    p.add_argument("--prefill-len", type=int, default=2048, help="the long prompt (default: 2048)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per measurement (default: 3)")
    p.add_argument("--num-threads", type=int, default=None, help="CPU threads (default: all cores)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                   help="activations of the quantized formats (default: auto)")
    p.add_argument("--output-dir", default=None, help="where to write JSON (default: bench/results)")


def _format_list(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    bad = [n for n in names if n not in FORMATS]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"formats must be among {', '.join(FORMATS)}, got {text!r}")
    return names


def kernel_plan(gguf: Path, num_threads: int | None) -> dict | None:
    """What the engine will run this model's quantized layers with on this machine, and why
    (cpu_kernels/dispatch.py: measured once per machine and shapes, then cached)."""
    import dataclasses

    from common.process_args import default_num_threads
    from cpu_kernels import dispatch
    from engine.cpu_tuning import linear_shapes
    from engine.models.loader import read_arch_config
    chosen = dispatch.plan(linear_shapes(read_arch_config(gguf)), num_threads or default_num_threads())
    machine = dispatch.machine_plan()
    if chosen is None:
        print("CPU kernel plan: no quantized kernel runs here (plain torch)")
        return None
    print(f"CPU kernel plan for this model: {chosen.reason()}")
    if machine is not None:
        print(f"--dtype auto on this machine: {machine.dtype} ({machine.reason()})")
    return {"model": dataclasses.asdict(chosen), "dtype_auto": machine.dtype if machine else None}


def run(args: argparse.Namespace) -> int:
    from engine.models.source import model_files
    gguf = model_files(args)
    plan = kernel_plan(gguf, args.num_threads)
    results = {}
    for name in args.formats:
        spec = {"dtype": args.dtype} | FORMATS[name]
        model = _source(gguf, spec)
        print(f"\n== {name}: {model} {spec}")
        results[name] = measure(str(model), spec, args)
        results[name]["file_mib"] = round(model_bytes(model) / 2**20, 1)
    ratios = _ratios(results)
    _report(results, ratios)
    targets = _targets(results)
    path = write_result("formats", {
        "machine": machine_info("cpu"), "model": str(gguf),
        "workload": {k: getattr(args, k) for k in ("input_len", "output_len", "batch", "prefill_len",
                                                   "repeats", "num_threads", "dtype")},
        "text": {"file": TEXT.name, "words": len(TEXT.read_text().split())},
        "kernel_plan": plan, "results": results, "ratios_to_float32": ratios, "targets": targets},
        args.output_dir)
    chart = _plot(results, path.with_suffix(".png"))
    print(f"\nwrote {path} and {chart.name}")
    return 0


def _source(gguf: Path, spec: dict) -> Path:
    """The files a format runs (popping the spec's source keys: the rest are LLM arguments)."""
    from bench.format_sources import gguf_requantized, hf_checkpoint
    if spec.pop("hf", False):
        return hf_folder(gguf)
    if body := spec.pop("gguf", None):
        return gguf_requantized(gguf, body)
    if kind := spec.pop("checkpoint", None):
        return hf_checkpoint(kind, hf_folder(gguf))
    return gguf


def measure(model: str, spec: dict, args) -> dict:
    import gc

    from pagedserve import LLM, SamplingParams
    rss_model = load_rss(model, {"num_threads": args.num_threads, **spec})
    llm = LLM(model, enable_prefix_caching=False, num_threads=args.num_threads, **spec)
    vocab = llm.engine.vocab_size
    rng = random.Random(0)
    prompts = [[rng.randrange(100, vocab) for _ in range(args.input_len)] for _ in range(args.batch)]
    greedy = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))  # warm-up
    out = {"dtype": llm.engine.config.dtype, "perplexity": perplexity(llm), "rss_mib": round(rss_model / 2**20, 1)}
    single = time_engine_single(llm, prompts[0], args.output_len, args.repeats)
    out["tpot_ms"] = 1e3 / single["decode_tok_s"]
    times = []
    for _ in tqdm(range(args.repeats), desc=f"{args.batch} streams", unit="run"):
        start = time.perf_counter()
        llm.generate(prompts, greedy)
        times.append(time.perf_counter() - start)
    out["batch_output_tok_s"] = args.batch * args.output_len / median(times)
    long_prompt = [rng.randrange(100, vocab) for _ in range(args.prefill_len)]
    times = []
    for _ in tqdm(range(args.repeats), desc="prefill", unit="run"):
        start = time.perf_counter()
        llm.generate([long_prompt], SamplingParams(temperature=0, max_tokens=1))
        times.append(time.perf_counter() - start)
    out["prefill_tok_s"] = args.prefill_len / median(times)
    out["weights"] = describe_weights(llm)
    llm.engine.model_runner.close()
    del llm
    gc.collect()
    return out


def perplexity(llm) -> float:
    from pagedserve import SamplingParams
    out = llm.generate(TEXT.read_text(), SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
    nll = [-next(iter(entry.values())) for entry in out.prompt_logprobs[1:]]
    return math.exp(sum(nll) / len(nll))


def describe_weights(llm) -> dict:
    """Parameter bytes by storage type: what each step streams from memory (and the copies a
    layer keeps beside its blocks: int8's or AMX's unpacked bf16)."""
    from engine.layers.fp8 import Fp8Linear
    from engine.layers.quantized import QuantLinear
    model = llm.engine.model_runner.model
    sizes: dict[str, int] = {}
    seen = set()
    for module in model.modules():
        tensors = [*module.parameters(recurse=False), *module.buffers(recurse=False)]
        key = "dense"
        if isinstance(module, QuantLinear):
            key = f"quantized {module.format}"
            tensors.append(module.unpacked)
        elif isinstance(module, Fp8Linear):
            key = "fp8"
            if module.packed is not None:
                tensors += [module.packed.data, module.packed.scales]
        for t in tensors:
            if t is not None and id(t) not in seen:
                seen.add(id(t))
                sizes[key] = sizes.get(key, 0) + t.numel() * t.element_size()
    return {k: round(v / 2**20, 1) for k, v in sizes.items()} | {"unit": "MiB"}


def _ratios(results: dict, baseline: str = "float32") -> dict:
    base = results.get(baseline)
    if base is None:
        return {}
    return {name: _ratio(r, base) for name, r in results.items()}


def _ratio(r: dict, base: dict) -> dict:
    return {"perplexity": r["perplexity"] / base["perplexity"],
            "tpot_speedup": base["tpot_ms"] / r["tpot_ms"],
            "batch_speedup": r["batch_output_tok_s"] / base["batch_output_tok_s"],
            "prefill_speedup": r["prefill_tok_s"] / base["prefill_tok_s"]}


def _targets(results: dict) -> list[dict]:
    """Each target whose formats both ran, met or not (printed, and kept in the JSON)."""
    rows = []
    for name, baseline, measure, least in TARGETS:
        if name in results and baseline in results:
            value = _ratio(results[name], results[baseline])[measure]
            rows.append(dict(format=name, baseline=baseline, measure=measure, value=round(value, 3),
                             target=least, met=value >= least))
    for name, r in results.items():
        if name in INT4_CHECKPOINTS:
            ratio = r["rss_mib"] / r["file_mib"]
            rows.append(dict(format=name, baseline="its files", measure="rss_to_file", value=round(ratio, 3),
                             target=INT4_RSS_TO_FILE, met=ratio <= INT4_RSS_TO_FILE))
    if rows:
        print_table(["format", "against", "measure", "value", "target", "met"],
                    [[t["format"], t["baseline"], t["measure"], f"{t['value']:.3f}",
                      ("<= " if t["measure"] == "rss_to_file" else ">= ") + f"{t['target']}", t["met"]]
                     for t in rows])
    return rows


def _report(results: dict, ratios: dict) -> None:
    rows = []
    for name, r in results.items():
        ratio = ratios.get(name, {})
        rows.append([name, r["dtype"], f"{r['perplexity']:.3f}", f"{ratio.get('perplexity', math.nan):.4f}",
                     f"{r['tpot_ms']:.1f}", f"{r['batch_output_tok_s']:.0f}", f"{r['prefill_tok_s']:.0f}",
                     round(sum(v for k, v in r["weights"].items() if k != "unit"), 1), r["file_mib"], r["rss_mib"]])
    print_table(["format", "activations", "perplexity", "ppl / fp32", "TPOT ms (1 stream)", "tok/s (batch)",
                 "prefill tok/s", "weights MiB", "file MiB", "RSS MiB"], rows)


def _plot(results: dict, path: Path) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    names = list(results)
    panels = [("tpot_ms", "TPOT, one stream (ms, lower is better)"),
              ("batch_output_tok_s", "output tok/s, batch (higher is better)"),
              ("prefill_tok_s", "prefill tok/s (higher is better)")]
    fig, axes = plt.subplots(1, 3, figsize=(13, 0.45 * len(names) + 1.8))
    for ax, (key, title) in zip(axes, panels):
        bars = ax.barh(names, [results[n][key] for n in names], color="tab:blue")
        ax.bar_label(bars, fmt="%.0f" if key != "tpot_ms" else "%.1f", padding=3)
        ax.set_title(title, fontsize=9)
        ax.invert_yaxis()
        ax.margins(x=0.2)
    axes[0].set_yticks(range(len(names)), [f"{n} ({results[n]['dtype']})\nppl {results[n]['perplexity']:.2f}"
                                           for n in names])
    return save_figure(fig, path)
