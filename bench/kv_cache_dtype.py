"""`python -m bench.kv_cache_dtype` (or `pagedserve bench kv-cache`): what --kv-cache-dtype int8
(and fp8) buys and costs against the unquantized cache, in one run (issue 50, item 1).

For each KV cache dtype (auto: the model's --dtype, bf16 by default; int8; fp8), in-process
`LLM`s of the same GGUF (default: the bundled SmolLM2), prefix caching off:
  - perplexity on bench/data/perplexity.txt (the engine's prompt logprobs, as bench.cpu_arithmetic
    measures it: its text_logprobs), and its ratio to auto's (issue 50's target: within 1%);
  - greedy agreement with auto on the QA prompts bench.cpu_arithmetic uses (its qa_prompts):
    the share of outputs equal to auto's, and the mean share of leading tokens that agree;
  - capacity at a fixed --kv-cache-memory-gb: how many sequences of --prompt-len + --output-len
    tokens the KV blocks the engine allocated hold at once (vLLM's start-up "maximum
    concurrency": KV tokens / tokens a sequence; target: >= 1.9x auto's);
  - the saturated run in that memory: --num-prompts prompts of --prompt-len random tokens, each
    generating --output-len tokens (eos ignored), all submitted at once: the peak of running
    sequences over the engine's steps (the scheduler admits a prompt for its prompt's blocks,
    so this peak overcommits and preempts as sequences grow), the preemptions, and the output
    tokens per second of the whole run (target: >= 1.3x).
Choose the memory so that auto's cache holds only a few such sequences (KV-bound): the default
0.1 GiB holds ~3.9 sequences of 1,128 tokens in bf16 for SmolLM2 (23,040 bytes a token), ~7.5 in
int8. Prints a table; writes JSON (the machine and its CPU flags) and a PNG to bench/results/.
"""

from __future__ import annotations

import argparse
import gc
import random
import sys
import time
from pathlib import Path

from tqdm import tqdm

from bench import cpu_arithmetic_report as report
from bench.cpu_arithmetic import TEXT, qa_prompts, text_logprobs
from bench.reporting import machine_info, name_plot, print_table, write_result

KV_DTYPES = ("auto", "int8", "fp8")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="a GGUF file (default: the bundled SmolLM2)")
    p.add_argument("--kv-cache-dtypes", default=list(KV_DTYPES), type=lambda s: [n.strip() for n in s.split(",")],
                   help="comma-separated, from auto, int8, fp8 (default: all); auto first: the others' baseline")
    p.add_argument("--dtype", default="bfloat16", help="the model's dtype, and so auto's cache (default: bfloat16)")
    p.add_argument("--cpu-arithmetic", default="auto", help="the quantized layers' arithmetic (default: auto)")
    p.add_argument("--kv-cache-memory-gb", type=float, default=0.1,
                   help="the KV cache for the capacity run, in GiB (default: 0.1)")
    p.add_argument("--prompt-len", type=int, default=1000, help="capacity run: tokens per prompt (default: 1000)")
    p.add_argument("--output-len", type=int, default=128, help="capacity run: tokens generated (default: 128)")
    p.add_argument("--num-prompts", type=int, default=24, help="capacity run: prompts submitted at once (default: 24)")
    p.add_argument("--greedy-prompts", type=int, default=30, help="QA prompts for greedy agreement (default: 30)")
    p.add_argument("--greedy-len", type=int, default=32, help="greedy tokens per QA prompt (default: 32)")
    p.add_argument("--num-threads", type=int, default=2, help="CPU threads (default: 2)")
    p.add_argument("--output-dir", default=None, help="where to write JSON and PNG (default: bench/results)")


def run(args: argparse.Namespace) -> int:
    from engine.models.loader import load_tokenizer
    from engine.models.source import model_files
    names = args.kv_cache_dtypes
    if names[0] != "auto" or any(n not in KV_DTYPES for n in names):
        print(f"--kv-cache-dtypes: auto first, then any of int8, fp8 (got {','.join(names)})")
        return 2
    gguf = model_files(args)
    tokenizer = load_tokenizer(gguf)
    text_ids = tokenizer.encode(TEXT.read_text())
    questions = [tokenizer.encode(p) for p in qa_prompts()[:args.greedy_prompts]]
    rng = random.Random(0)
    vocab = len(tokenizer)
    loads = [[rng.randrange(3, vocab) for _ in range(args.prompt_len)] for _ in range(args.num_prompts)]
    print(f"{gguf.name}: {len(text_ids)} text tokens; {len(questions)} QA prompts x {args.greedy_len}; "
          f"{args.num_prompts} x ({args.prompt_len} + {args.output_len}) tokens in {args.kv_cache_memory_gb} GiB")
    results = {}
    for name in tqdm(names, desc="KV cache dtypes", unit="dtype"):
        results[name] = measure(gguf, name, text_ids, questions, loads, args)
    base = results["auto"]
    reference = base["greedy_tokens"]
    for r in results.values():
        r["perplexity_ratio"] = r["perplexity"] / base["perplexity"]
        r["greedy_vs_auto"] = report.greedy_agreement(r.pop("greedy_tokens"), reference)
        r["capacity_ratio"] = r["max_concurrency"] / base["max_concurrency"]
        r["peak_running_ratio"] = r["peak_running"] / base["peak_running"]
        r["throughput_ratio"] = r["output_tok_s"] / base["output_tok_s"]
    print_report(results)
    path = write_result("kv-cache-dtype", {
        "machine": machine_info("cpu"), "model": str(gguf),
        "workload": {k: getattr(args, k) for k in ("dtype", "cpu_arithmetic", "kv_cache_memory_gb", "prompt_len",
                                                   "output_len", "num_prompts", "greedy_len", "num_threads")}
        | {"text": TEXT.name, "text_tokens": len(text_ids), "greedy_prompts": len(questions)},
        "targets": {"perplexity_ratio_max": 1.01, "capacity_ratio_min": 1.9, "throughput_ratio_min": 1.3},
        "results": results}, args.output_dir)
    chart = plot(results, path)
    print(f"\nwrote {path} and {chart.name}")
    return 0


def measure(gguf: Path, name: str, text_ids: list[int], questions: list[list[int]], loads: list[list[int]],
            args) -> dict:
    from pagedserve import LLM, SamplingParams
    common = dict(dtype=args.dtype, cpu_arithmetic=args.cpu_arithmetic, kv_cache_dtype=name,
                  enable_prefix_caching=False, num_threads=args.num_threads)
    # Accuracy: a cache big enough for the text in one sequence.
    llm = LLM(str(gguf), kv_cache_memory_gb=1.0, max_model_len=len(text_ids) + 8, **common)
    out = {"kv_bytes_per_token": llm.engine.model_runner._bytes_per_block() // llm.config.block_size}
    logprobs, target_lps = text_logprobs(llm, text_ids)
    out["perplexity"] = report.perplexity(target_lps)
    params = SamplingParams(temperature=0, max_tokens=args.greedy_len, ignore_eos=True)
    out["greedy_tokens"] = [o.outputs[0].token_ids for o in llm.generate(questions, params)]
    _close(llm)
    del logprobs
    llm = LLM(str(gguf), kv_cache_memory_gb=args.kv_cache_memory_gb, max_model_len=args.prompt_len + args.output_len,
              **common)
    out.update(saturate(llm, loads, args.output_len))
    # vLLM's "maximum concurrency" (KV tokens / tokens a sequence), from the blocks allocated
    out["max_concurrency"] = out["num_kv_blocks"] * llm.config.block_size / (args.prompt_len + args.output_len)
    _close(llm)
    return out


def saturate(llm, prompts: list[list[int]], output_len: int) -> dict:
    """Every prompt submitted at once, stepped to the end: the peak of running sequences, and
    the output tokens per second of the whole run."""
    from pagedserve import SamplingParams
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    for i, ids in enumerate(prompts):
        engine.add_request(f"load-{i}", ids, params)
    peak, steps, start = 0, 0, time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
        peak = max(peak, engine.stats().num_running)
    elapsed = time.perf_counter() - start
    stats = engine.stats()
    return {"num_kv_blocks": stats.num_kv_blocks, "peak_running": peak, "num_preemptions": stats.num_preemptions,
            "steps": steps, "elapsed_s": elapsed, "output_tok_s": len(prompts) * output_len / elapsed}


def _close(llm) -> None:
    llm.engine.model_runner.close()
    gc.collect()


def print_report(results: dict) -> None:
    print()
    print_table(["kv cache", "bytes/token", "perplexity", "ratio", "greedy =", "leading", "blocks", "seqs held",
                 "x auto", "peak running", "out tok/s", "x auto", "preempt"],
                [[n, r["kv_bytes_per_token"], r["perplexity"], f"{r['perplexity_ratio']:.4f}",
                  f"{r['greedy_vs_auto']['exact']:.2f}", f"{r['greedy_vs_auto']['leading']:.2f}", r["num_kv_blocks"],
                  f"{r['max_concurrency']:.2f}", f"{r['capacity_ratio']:.2f}", r["peak_running"], r["output_tok_s"],
                  f"{r['throughput_ratio']:.2f}", r["num_preemptions"]] for n, r in results.items()])


def plot(results: dict, path: Path) -> Path:
    from bench.plots import plot_panels
    panels = [("perplexity", "perplexity"), ("max_concurrency", "sequences the KV cache holds"),
              ("output_tok_s", "output tok/s at saturation")]
    title = f"KV cache dtypes ({path.stem})"
    return name_plot(path, plot_panels(results, panels, title, path.with_suffix(".png")))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
