"""How much of a decode step the LM head and the sampler take, for a large-vocabulary model
(Gemma 3: 262,144 tokens, 640 wide). Times the engine's own steps, with the head
(`compute_logits`) and the sampler wrapped in timers.

    python -m bench.lm_head_share [--model PATH] [--batch 1 16] [--dtype float32 bfloat16]
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch


def _timed(fn, acc: dict, key: str):
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        out = fn(*args, **kwargs)
        acc[key] += time.perf_counter() - start
        return out
    return wrapper


def measure(model: str, dtype: str, batches: list[int], steps: int, sampling: dict) -> list[dict]:
    from pagedserve import LLM, SamplingParams
    llm = LLM(model, dtype=dtype, enable_prefix_caching=False)
    runner = llm.engine.model_runner
    acc = {"head": 0.0, "sampler": 0.0, "step": 0.0}
    runner.model.compute_logits = _timed(runner.model.compute_logits, acc, "head")
    runner.sampler = type("Timed", (), {"__call__": staticmethod(_timed(runner.sampler, acc, "sampler"))})()
    runner.execute = _timed(runner.execute, acc, "step")
    results = []
    for batch in batches:
        for name, kw in sampling.items():
            params = SamplingParams(max_tokens=steps, min_tokens=steps, ignore_eos=True, seed=0, **kw)
            prompts = [[2, 651 + i, 1234, 5678] for i in range(batch)]
            llm.generate(prompts, SamplingParams(max_tokens=2, ignore_eos=True))  # warm up
            acc.update(head=0.0, sampler=0.0, step=0.0)
            llm.generate(prompts, params)
            results.append({
                "dtype": dtype, "batch": batch, "sampling": name, "steps": steps,
                "step_ms": 1000 * acc["step"] / steps, "head_ms": 1000 * acc["head"] / steps,
                "sampler_ms": 1000 * acc["sampler"] / steps,
                "head_share": acc["head"] / acc["step"], "sampler_share": acc["sampler"] / acc["step"]})
            print(json.dumps(results[-1]), flush=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a GGUF or HF folder (default: the bundled Gemma 3 270M)")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args()
    load = os.getloadavg()  # the machine is shared: say how busy it was
    from engine.models.source import gemma3_model_path
    model = args.model or str(gemma3_model_path())
    sampling = {"greedy": dict(temperature=0.0),
                "top_k50_top_p0.95": dict(temperature=0.8, top_k=50, top_p=0.95),
                "top_p0.95": dict(temperature=0.8, top_p=0.95)}
    rows = [r for dtype in args.dtype for r in measure(model, dtype, args.batch, args.steps, sampling)]
    result = {"model": os.path.basename(model), "torch_threads": torch.get_num_threads(),
              "loadavg_before": load, "loadavg_after": os.getloadavg(), "results": rows}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
