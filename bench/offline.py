"""`pagedserve bench offline`: engine throughput on a fixed workload, against HF transformers.

Workload (defaults): 64 prompts of 128 random token ids, 128 output tokens each,
greedy, eos ignored so every request produces exactly --output-len tokens. The model is the
bundled one, --model, or --random-weights SHAPE (bench/random_model.py: nothing to download).
Measured, each a median over --repeats runs:
  - engine aggregate output throughput (all prompts in one `generate`)
  - engine single-request decode rate (one prompt alone, excluding its prefill)
  - with --compare-hf: HF `generate` on the same model folder and prompts, on the engine's
    --device, one by one (bs 1) and in static batches of --hf-batch-size.
"""

from __future__ import annotations

import argparse
import random
import time

from tqdm import tqdm

from bench.plots import plot_offline
from bench.random_model import add_random_weights_arg, use_random_weights
from bench.reporting import machine_info, median, print_table, write_result
from engine.arg_utils import add_engine_args, engine_config_from_args


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--num-prompts", type=int, default=64, help="prompts in the workload (default: 64)")
    p.add_argument("--input-len", type=int, default=128, help="prompt tokens (default: 128)")
    p.add_argument("--output-len", type=int, default=128, help="output tokens per prompt (default: 128)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per measurement (default: 3)")
    p.add_argument("--single-repeats", type=int, default=7,
                   help="runs of the single-request decode measurement; cheap, and noisier than "
                        "the batch, so more of them (default: 7)")
    p.add_argument("--seed", type=int, default=0, help="seed for the random prompts (default: 0)")
    p.add_argument("--compare-hf", action="store_true",
                   help="also run HF transformers generate on the same model folder, on --device")
    p.add_argument("--hf-batch-size", type=int, default=32, help="HF static batch size (default: 32)")
    p.add_argument("--hf-dtypes", default="float32,bfloat16", type=_dtype_list,
                   help="comma-separated dtypes to run HF in (default: float32,bfloat16; "
                        "float32 is what HF loads a GGUF as)")
    p.add_argument("--hf-sequential-prompts", type=int, default=None,
                   help="run HF bs=1 on only the first N prompts (default: all; the rate barely "
                        "depends on N)")
    p.add_argument("--output-dir", default=None, help="where to write JSON (default: bench/results)")
    add_random_weights_arg(p)
    add_engine_args(p, dtype="auto")


def _dtype_list(text: str) -> list[str]:
    dtypes = [d.strip() for d in text.split(",") if d.strip()]
    bad = [d for d in dtypes if d not in ("float32", "bfloat16", "float16")]
    if bad or not dtypes:
        raise argparse.ArgumentTypeError(f"dtypes must be float32, bfloat16 or float16, got {text!r}")
    return dtypes


def random_prompts(n: int, length: int, vocab_size: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    # Skip the lowest ids: special tokens live there in most vocabularies.
    return [[rng.randrange(100, vocab_size) for _ in range(length)] for _ in range(n)]


def run(args: argparse.Namespace) -> int:
    from pagedserve import LLM, SamplingParams
    use_random_weights(args, "bench offline")
    config = engine_config_from_args(args)
    llm = LLM(**vars(config))
    prompts = random_prompts(args.num_prompts, args.input_len, llm.engine.vocab_size, args.seed)
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))  # warm-up
    results = {"engine_batch": _time_engine_batch(llm, prompts, params, args.repeats),
               "engine_single": time_engine_single(llm, prompts[0], args.output_len, args.single_repeats)}
    if args.compare_hf:
        results.update(_time_hf(llm, prompts, args))
    ratios = _ratios(results)
    _report(results, ratios)
    path = write_result("offline", {
        "machine": machine_info(config.device), "engine_config": vars(config),
        "workload": {k: getattr(args, k) for k in ("num_prompts", "input_len", "output_len", "seed",
                                                   "repeats", "single_repeats", "hf_batch_size", "hf_dtypes",
                                                   "random_weights")},
        "results": results, "ratios": ratios}, args.output_dir)
    chart = plot_offline(results, f"offline, {args.num_prompts} prompts x {args.input_len} in / "
                         f"{args.output_len} out, engine {config.dtype}", path.with_suffix(".png"))
    print(f"\nwrote {path} and {chart.name}")
    return 0


def _time_engine_batch(llm, prompts, params, repeats: int) -> dict:
    times = []
    for _ in tqdm(range(repeats), desc="engine, all prompts", unit="run"):
        llm.reset_prefix_cache()  # each run pays for its prefills, as the first one did
        start = time.perf_counter()
        outs = llm.generate(prompts, params)
        times.append(time.perf_counter() - start)
        assert all(len(o.outputs[0].token_ids) == params.max_tokens for o in outs)
    tokens = len(prompts) * params.max_tokens
    # With --output-len 1 the run is all prefill: prompt tok/s is then the prefill rate.
    return {"output_tokens": tokens, "seconds": times, "output_tok_s": tokens / median(times),
            "prompt_tok_s": sum(map(len, prompts)) / median(times)}


def time_engine_single(llm, prompt: list[int], output_len: int, repeats: int) -> dict:
    """Decode rate of one request alone: tokens after the first over the time after it."""
    from pagedserve import SamplingParams
    core, rates, ttfts = llm.engine, [], []
    for i in tqdm(range(repeats), desc="engine, one request", unit="run"):
        core.reset_prefix_cache()
        core.add_request(f"bench-single-{i}", prompt,
                         SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True))
        start, first = time.perf_counter(), None
        while core.has_unfinished_requests():
            core.step()
            first = first or time.perf_counter()
        end = time.perf_counter()
        ttfts.append(first - start)
        rates.append((output_len - 1) / (end - first))
    return {"decode_tok_s": median(rates), "decode_tok_s_runs": rates, "ttft_s": median(ttfts)}


def _time_hf(llm, prompts, args) -> dict:
    from bench.hf_reference import load_hf_float32
    from engine.models.loader import DTYPES
    out = {}
    seq_prompts = prompts[:args.hf_sequential_prompts] if args.hf_sequential_prompts else prompts
    for dtype in args.hf_dtypes:
        model = load_hf_float32(llm.engine.model_path).to(device=llm.config.device, dtype=DTYPES[dtype])
        out[f"hf_{dtype}_sequential"] = _time_hf_batches(
            model, seq_prompts, 1, args.output_len, f"HF {dtype} bs=1")
        out[f"hf_{dtype}_batch{args.hf_batch_size}"] = _time_hf_batches(
            model, prompts, args.hf_batch_size, args.output_len, f"HF {dtype} bs={args.hf_batch_size}")
        del model
    return out


def _time_hf_batches(model, prompts, batch_size: int, output_len: int, label: str) -> dict:
    import torch
    start = time.perf_counter()
    for i in tqdm(range(0, len(prompts), batch_size), desc=label, unit="batch"):
        batch = torch.tensor(prompts[i:i + batch_size], device=model.device)  # equal lengths: no padding
        with torch.inference_mode():
            model.generate(batch, attention_mask=torch.ones_like(batch), max_new_tokens=output_len,
                           min_new_tokens=output_len, do_sample=False, pad_token_id=0)
    if model.device.type == "cuda":
        torch.cuda.synchronize(model.device)
    seconds = time.perf_counter() - start
    tokens = len(prompts) * output_len
    return {"output_tokens": tokens, "seconds": [seconds], "output_tok_s": tokens / seconds}


def _ratios(results: dict) -> dict:
    engine = results["engine_batch"]["output_tok_s"]
    return {f"engine_vs_{k}": engine / v["output_tok_s"] for k, v in results.items()
            if k.startswith("hf_")}


def _report(results: dict, ratios: dict) -> None:
    rows = [[name, r["output_tok_s"], median(r["seconds"])]
            for name, r in results.items() if "output_tok_s" in r]
    print()
    print_table(["run", "output tok/s", "seconds (median)"], rows)
    print(f"\nengine, all prompts: {results['engine_batch']['prompt_tok_s']:.0f} prompt tok/s (with their decode)")
    print(f"single-request decode: {results['engine_single']['decode_tok_s']:.1f} tok/s, "
          f"TTFT {results['engine_single']['ttft_s'] * 1000:.0f} ms")
    for name, ratio in ratios.items():
        print(f"{name}: {ratio:.2f}x")
