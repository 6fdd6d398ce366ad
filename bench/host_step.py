"""`pagedserve bench host-step`: the engine's host time per decode step at 256 concurrent
sequences, the proxy for a GPU's idle time that any CPU can measure.

The model is the "tiny" random-weight shape (bench/random_model.py: one layer, hidden 64, a
1,024-token LM head) so its forward costs almost nothing. Each decode step is timed as a whole
(`EngineCore.step()`), and so is the model's own work inside it (the forward and the LM head,
timed by wrapping them): the difference is the host's work per step, which on a GPU is what
the device waits for unless it overlaps. The offline `LLM`'s output processing (detokenization,
stop strings) is timed on its own: on a server it runs in the frontend process.

`--baseline REF` measures a git commit the same way in the same run (from a temporary
worktree, in a child process): the before/after that the README quotes. The measurement
below therefore uses only interfaces every commit has (EngineCore, OutputProcessor).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

DEFAULT_SEQS = 256
# The requests' sampling settings, by --sampling name (keyword arguments of SamplingParams;
# "seed" is replaced by a seed per request).
SAMPLING = {"greedy": {"temperature": 0.0}, "seeded": {"temperature": 0.8, "seed": 0}}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--num-seqs", type=int, default=DEFAULT_SEQS, help="concurrent sequences (default: 256)")
    p.add_argument("--input-len", type=int, default=128, help="prompt tokens (default: 128)")
    p.add_argument("--output-len", type=int, default=64, help="output tokens per sequence (default: 64)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs; the best is kept (default: 3)")
    p.add_argument("--sampling", choices=sorted(SAMPLING), default="greedy",
                   help="greedy (default), or seeded: temperature 0.8 and a seed per request (the sampler's "
                        "per-row work; top-p would add a sort that dominates on the tiny model's vocabulary)")
    p.add_argument("--baseline", default=None, metavar="REF",
                   help="also measure this git commit, in the same run (e.g. HEAD~3)")
    p.add_argument("--profile", action="store_true", help="print a cProfile of the decode steps")
    p.add_argument("--output-dir", default=None, help="where to write JSON (default: bench/results)")
    # Internal: a child process measuring another checkout (see --baseline).
    p.add_argument("--measure-only", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--model-dir", default=None, help=argparse.SUPPRESS)


def measure(model_dir: str, num_seqs: int, input_len: int, output_len: int, repeats: int,
            profile: bool = False, sampling: str = "greedy") -> dict:
    """Best-of-`repeats` per-step means over the decode steps of one workload."""
    import torch

    from engine.config import EngineConfig
    from engine.core import EngineCore
    from engine.models.loader import eos_token_ids, load_tokenizer
    from engine.sampling_params import SamplingParams
    from frontend.output_processor import OutputProcessor
    torch.set_flush_denormal(True)
    tokenizer = load_tokenizer(Path(model_dir))
    blocks = num_seqs * (-(-(input_len + output_len) // 16) + 1)
    config = EngineConfig(model=model_dir, dtype="float32", max_num_seqs=num_seqs, num_kv_blocks=blocks,
                          max_num_batched_tokens=max(2048, num_seqs), enable_prefix_caching=False)
    core = EngineCore(config, eos_token_ids(tokenizer), tokenizer=tokenizer)
    model_s = _time_model(core.model_runner.model)
    settings = SAMPLING[sampling]
    runs = []
    for run in range(repeats):
        processor = OutputProcessor(tokenizer, core.eos_token_ids)
        for i in range(num_seqs):
            seed = {"seed": i} if "seed" in settings else {}
            params = SamplingParams(**{**settings, **seed}, max_tokens=output_len, ignore_eos=True)
            prompt = [100 + (i * 7 + j * 13) % 900 for j in range(input_len)]
            core.add_request(f"{run}-{i}", prompt, params)
            processor.add_request(f"{run}-{i}", prompt, params)
        runs.append(_decode_steps(core, processor, model_s, num_seqs, profile and run == repeats - 1))
    best = min(runs, key=lambda r: r["host_ms"])
    return {**best, "runs": runs, "engine_file": sys.modules["engine"].__file__}


def _time_model(model) -> list[float]:
    """Wrap the model's forward and LM head so each call adds its wall time to the list."""
    spent = [0.0]
    for name in ("forward", "compute_logits"):
        inner = getattr(model, name)

        def timed(*args, _inner=inner, **kwargs):
            start = time.perf_counter()
            try:
                return _inner(*args, **kwargs)
            finally:
                spent[0] += time.perf_counter() - start
        setattr(model, name, timed)
    return spent


def _decode_steps(core, processor, model_s: list[float], num_seqs: int, profile: bool) -> dict:
    """Step until done; time the steps in which every sequence decodes (all have a token)."""
    started: set[str] = set()
    steps, step_s, forward_s, output_s = 0, 0.0, 0.0, 0.0
    profiler = None
    while core.has_unfinished_requests():
        decoding = len(started) == num_seqs
        if decoding and profile and profiler is None:
            import cProfile
            profiler = cProfile.Profile()
            profiler.enable()
        model_s[0] = 0.0
        start = time.perf_counter()
        outputs = core.step()
        stepped = time.perf_counter()
        processor.process_outputs(outputs)
        done = time.perf_counter()
        if decoding and len(outputs) == num_seqs:
            steps += 1
            step_s += stepped - start
            forward_s += model_s[0]
            output_s += done - stepped
        started.update(o.request_id for o in outputs)
    if profiler is not None:
        import pstats
        profiler.disable()
        pstats.Stats(profiler).sort_stats("tottime").print_stats(45)
    steps = max(steps, 1)
    return {"decode_steps": steps, "step_ms": 1e3 * step_s / steps, "forward_ms": 1e3 * forward_s / steps,
            "host_ms": 1e3 * (step_s - forward_s) / steps, "output_ms": 1e3 * output_s / steps}


def measure_ref(ref: str, args: argparse.Namespace, model_dir: Path) -> dict:
    """Run `measure` on commit `ref`, checked out in a temporary worktree, in a child process."""
    root = Path(__file__).resolve().parent.parent
    sha = subprocess.check_output(["git", "-C", str(root), "rev-parse", ref], text=True).strip()
    with tempfile.TemporaryDirectory(prefix="pagedserve-baseline-") as tmp:
        tree = Path(tmp) / "tree"
        subprocess.run(["git", "-C", str(root), "worktree", "add", "--detach", str(tree), sha],
                       check=True, capture_output=True)
        try:
            cmd = [sys.executable, str(Path(__file__).resolve()), "--measure-only", "--model-dir", str(model_dir),
                   "--num-seqs", str(args.num_seqs), "--input-len", str(args.input_len),
                   "--output-len", str(args.output_len), "--repeats", str(args.repeats)]
            if args.sampling != "greedy":  # (older commits know greedy only)
                cmd += ["--sampling", args.sampling]
            env = {**os.environ, "PYTHONPATH": str(tree)}
            out = subprocess.run(cmd, cwd=tree, env=env, check=True, capture_output=True, text=True).stdout
        finally:
            subprocess.run(["git", "-C", str(root), "worktree", "remove", "--force", str(tree)], check=False)
    return {**json.loads(out.strip().splitlines()[-1]), "commit": sha}


def run(args: argparse.Namespace) -> int:
    if args.measure_only:  # the child of --baseline: one JSON line on stdout
        print(json.dumps(measure(args.model_dir, args.num_seqs, args.input_len, args.output_len, args.repeats,
                                 sampling=args.sampling)))
        return 0
    from bench.common import RESULTS_DIR, machine_info, print_table, write_result
    from bench.plots import plot_host_step
    from bench.random_model import random_model_dir
    model_dir = random_model_dir("tiny", "float32")
    head = subprocess.check_output(["git", "-C", str(Path(__file__).resolve().parent.parent),
                                    "rev-parse", "HEAD"], text=True).strip()
    results = {}
    if args.baseline:
        results["baseline"] = measure_ref(args.baseline, args, model_dir)
    results["current"] = {**measure(str(model_dir), args.num_seqs, args.input_len, args.output_len, args.repeats,
                                    args.profile, args.sampling), "commit": head}
    rows = [[name, r["commit"][:10], f"{r['step_ms']:.2f}", f"{r['forward_ms']:.2f}", f"{r['host_ms']:.2f}",
             f"{r['output_ms']:.2f}"] for name, r in results.items()]
    print_table(["build", "commit", "step ms", "model ms", "host ms", "output ms"], rows)
    ratios = {}
    if "baseline" in results:
        base, cur = results["baseline"], results["current"]
        ratios = {"host_ratio": cur["host_ms"] / base["host_ms"],
                  "output_ratio": cur["output_ms"] / base["output_ms"]}
        print(f"host time per step: {ratios['host_ratio']:.3f}x the baseline's "
              f"(1/{1 / ratios['host_ratio']:.1f}); output processing {ratios['output_ratio']:.3f}x")
    payload = {"machine": machine_info(),
               "workload": {"num_seqs": args.num_seqs, "input_len": args.input_len,
                            "output_len": args.output_len, "model": "random tiny (bench/random_model.py)",
                            "sampling": SAMPLING[args.sampling]},
               "results": results, **ratios}
    path = write_result("host-step", payload, Path(args.output_dir) if args.output_dir else RESULTS_DIR)
    plot_host_step(payload, path.with_suffix(".png"))
    print(f"wrote {path}")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return run(parser.parse_args())


if __name__ == "__main__":
    sys.exit(main())
