"""`python -m bench.cpu_arithmetic` (or `pagedserve bench cpu-arithmetic`): the accuracy of each
CPU arithmetic for quantized layers against HF transformers float32, in one run (issue 49, item 3).

The arithmetics this machine runs, each an in-process `LLM` of the same GGUF (default: the bundled
SmolLM2), prefix caching off:
  float32      --dtype float32: exact products, float32 sums (csrc/quant_linear.cpp)
  avx512_bf16  --dtype bfloat16 with PAGEDSERVE_CPU_ARITHMETIC=avx512_bf16: bf16 activations times
               the weights as stored, float32 sums (VDPBF16PS)
  amx          the same with PAGEDSERVE_CPU_ARITHMETIC=amx: AMX tiles over bf16-rounded weights
               (where cpu_kernels.ops.bf16_amx_ready())
  int8         --dtype bfloat16 --cpu-arithmetic int8: activations rounded to 8 bits per block of
               32, exact integer dot products (csrc/int_dot.cpp; where int_dot_supported())
The reference is HF transformers' float32 model of the same GGUF, dequantized by transformers
(bench/hf_reference.py), on the same token ids. For each arithmetic:
  - perplexity on bench/data/perplexity.txt (our prompt logprobs; HF's from its logits), its
    ratio to HF float32's;
  - KL(HF float32 || ours) of the next-token distribution at each position of that text, mean
    and p99: our full logits are the model's compute_logits outputs, recorded while the
    prompt-logprob request runs (log_softmax in float32);
  - greedy agreement on the 30 questions of bench/lm_eval/qa.jsonl, each in the few-shot
    prompt of the pagedserve_qa_gen task (bench/lm_eval/pagedserve_qa_gen.yaml), --output-len
    tokens with eos ignored; HF's by generate(do_sample=False) with no eos: the share of
    prompts whose whole output equals HF's, and the mean share of leading tokens that agree.
Then issue 49's rule (bench/cpu_arithmetic_report.py): int8 may be the default only where its
perplexity is within 0.5% of float32's and its greedy agreement is at least bf16's. Prints a
table and the verdict; writes JSON (the machine, its CPU flags, each run's kernel plan) and a
PNG to bench/results/cpu-arithmetic-<stamp>.*.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
from pathlib import Path

from tqdm import tqdm

from bench import cpu_arithmetic_report as report
from bench.reporting import machine_info, write_result

DATA = Path(__file__).resolve().parent
TEXT = DATA / "data" / "perplexity.txt"
QUESTIONS = DATA / "lm_eval" / "qa.jsonl"
QA_TASK = DATA / "lm_eval" / "pagedserve_qa_gen.yaml"
# name -> (LLM arguments, PAGEDSERVE_CPU_ARITHMETIC; None: the plan's own choice)
ARITHMETICS = {
    "float32": (dict(dtype="float32"), None),
    "avx512_bf16": (dict(dtype="bfloat16"), "avx512_bf16"),
    "amx": (dict(dtype="bfloat16"), "amx"),
    "bfloat16": (dict(dtype="bfloat16"), None),  # only where no bf16 kernel runs (AVX2)
    "int8": (dict(dtype="bfloat16", cpu_arithmetic="int8"), None),
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="a GGUF file (default: the bundled SmolLM2)")
    p.add_argument("--arithmetics", default=None, type=lambda s: [n.strip() for n in s.split(",") if n.strip()],
                   help=f"comma-separated, from {', '.join(ARITHMETICS)} (default: all this machine runs)")
    p.add_argument("--output-len", type=int, default=32, help="greedy tokens per prompt (default: 32)")
    p.add_argument("--num-threads", type=int, default=2, help="CPU threads, ours and HF's (default: 2)")
    p.add_argument("--output-dir", default=None, help="where to write JSON and PNG (default: bench/results)")


def available() -> list[str]:
    """The arithmetics this CPU and build run, in ARITHMETICS order."""
    from cpu_kernels import ops
    names = ["float32"]
    if ops.bf16_dot_supported():
        names.append("avx512_bf16")
    if ops.bf16_amx_ready():
        names.append("amx")
    if not ops.bf16_dot_supported():
        names.append("bfloat16")
    if ops.int_dot_supported():
        names.append("int8")
    return names


def qa_prompts() -> list[str]:
    """Each question of qa.jsonl as the pagedserve_qa_gen task asks it: the task's few-shot
    description, then "Question: ...\\nAnswer:"."""
    import yaml
    task = yaml.safe_load(QA_TASK.read_text())
    questions = [json.loads(line)["question"] for line in QUESTIONS.read_text().splitlines() if line.strip()]
    return [task["description"] + task["doc_to_text"].replace("{{question}}", q) for q in questions]


def run(args: argparse.Namespace) -> int:
    import torch

    from engine.models.loader import load_tokenizer
    from engine.models.source import model_files
    names = args.arithmetics or available()
    unknown = [n for n in names if n not in available()]
    if unknown:
        print(f"not run on this machine: {', '.join(unknown)} (it runs {', '.join(available())})")
        return 2
    gguf = model_files(args)
    machine = machine_info("cpu")  # before any run sets PAGEDSERVE_CPU_ARITHMETIC
    torch.set_num_threads(args.num_threads)
    tokenizer = load_tokenizer(gguf)
    text_ids = tokenizer.encode(TEXT.read_text())
    prompts = [tokenizer.encode(p) for p in qa_prompts()]
    print(f"{gguf.name}: {len(text_ids)} text tokens, {len(prompts)} prompts x {args.output_len} greedy tokens")
    hf = hf_reference(gguf, text_ids, prompts, args.output_len)
    results = {}
    for name in tqdm(names, desc="arithmetics", unit="LLM"):
        results[name] = measure(gguf, name, text_ids, prompts, args, hf)
    judged = report.verdicts(results)
    print()
    report.print_report(results, hf["perplexity"], judged)
    path = write_result("cpu-arithmetic", {
        "machine": machine, "model": str(gguf),
        "workload": {"num_threads": args.num_threads, "output_len": args.output_len, "num_prompts": len(prompts),
                     "text_tokens": len(text_ids), "text": TEXT.name,
                     "prompt_set": f"{QUESTIONS.name} questions in {QA_TASK.name}'s few-shot prompt"},
        "hf_float32": {"perplexity": hf["perplexity"]},
        "results": results, "rule": report.RULE, "verdicts": judged}, args.output_dir)
    chart = report.plot(path)
    print(f"\nwrote {path} and {chart.name}")
    return 0


def hf_reference(gguf: Path, text_ids: list[int], prompts: list[list[int]], output_len: int) -> dict:
    """HF float32's log-probabilities at each text position but the last [T-1, V], its
    perplexity, and its greedy outputs; the model is released after."""
    import torch

    from bench.hf_reference import load_hf_float32
    model = load_hf_float32(gguf)
    with torch.inference_mode():
        logprobs = torch.log_softmax(model(torch.tensor([text_ids])).logits[0, :-1].float(), dim=-1)
        targets = logprobs.gather(1, torch.tensor(text_ids[1:]).unsqueeze(1)).squeeze(1)
        greedy = []
        for ids in tqdm(prompts, desc="HF float32 greedy", unit="prompt"):
            # eos_token_id=None: never stop nor mask eos, as our ignore_eos
            out = model.generate(torch.tensor([ids]), max_new_tokens=output_len, do_sample=False,
                                 eos_token_id=None, pad_token_id=0)
            greedy.append(out[0, len(ids):].tolist())
    del model
    gc.collect()
    return {"logprobs": logprobs, "perplexity": report.perplexity(targets.tolist()), "greedy": greedy}


def measure(gguf: Path, name: str, text_ids: list[int], prompts: list[list[int]], args, hf: dict) -> dict:
    from pagedserve import LLM, SamplingParams
    spec, forced = ARITHMETICS[name]
    previous = os.environ.get("PAGEDSERVE_CPU_ARITHMETIC")
    if forced:
        os.environ["PAGEDSERVE_CPU_ARITHMETIC"] = forced
    try:
        llm = LLM(str(gguf), enable_prefix_caching=False, num_threads=args.num_threads, **spec)
    finally:
        _restore_env(previous)
    plan = llm.engine.model_runner.kernel_plan
    out = {"llm_args": spec, "env": forced, "plan": _plan_name(spec, plan),
           "plan_reason": plan.reason() if plan else None}
    logprobs, target_lps = text_logprobs(llm, text_ids)
    out["perplexity"] = report.perplexity(target_lps)
    out["kl"] = report.kl_summary(report.kl_divergence(hf["logprobs"], logprobs))
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    ours = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    out["greedy"] = report.greedy_agreement(ours, hf["greedy"])
    out["greedy_leading_tokens"] = [report.leading_agreement(a, b) for a, b in zip(ours, hf["greedy"])]
    llm.engine.model_runner.close()
    del llm, logprobs
    gc.collect()
    return out


def text_logprobs(llm, text_ids: list[int]):
    """Our log-probabilities [T-1, V] at each text position but the last, and the prompt
    logprobs the engine returned for tokens 1..T-1. Each step runs the prompt slices' LM head
    first, then the sampling row's (position T-1, after the last chunk): in call order, the
    recorded rows are positions 0..T-1."""
    import torch

    from pagedserve import SamplingParams
    model = llm.engine.model_runner.model
    compute_logits, recorded = model.compute_logits, []

    def recording(hidden):
        logits = compute_logits(hidden)
        recorded.append(logits.float())
        return logits

    model.compute_logits = recording
    try:
        out = llm.generate([text_ids], SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
    finally:
        del model.compute_logits  # the class's method again
    logits = torch.cat(recorded)
    if logits.shape[0] != len(text_ids):
        raise RuntimeError(f"recorded {logits.shape[0]} rows of logits for a {len(text_ids)}-token text")
    logprobs = torch.log_softmax(logits[:-1], dim=-1)
    returned = [next(iter(entry.values())) for entry in out.prompt_logprobs[1:]]
    recomputed = logprobs.gather(1, torch.tensor(text_ids[1:]).unsqueeze(1)).squeeze(1)
    if (recomputed - torch.tensor(returned)).abs().max().item() > 1e-4:  # a recording out of step
        raise RuntimeError("the recorded logits disagree with the engine's prompt logprobs")
    return logprobs, returned


def _plan_name(spec: dict, plan) -> str:
    """What the quantized layers ran: float32, int8 (beside the bf16 kernel of what it leaves),
    or the bf16 plan's arithmetic."""
    if spec["dtype"] == "float32":
        return "float32"
    from cpu_kernels import ops
    bf16 = "amx" if plan is not None and plan.amx else "avx512_bf16" if ops.bf16_dot_supported() else "torch bf16"
    return f"int8 + {bf16}" if spec.get("cpu_arithmetic") == "int8" else bf16


def _restore_env(previous: str | None) -> None:
    if previous is None:
        os.environ.pop("PAGEDSERVE_CPU_ARITHMETIC", None)
    else:
        os.environ["PAGEDSERVE_CPU_ARITHMETIC"] = previous


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
