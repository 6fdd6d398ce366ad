"""`pagedserve bench host-step`: the engine's host time per decode step at 256 concurrent
sequences (or per prefill step, `--phase prefill`), the proxy for a GPU's idle time that any
CPU can measure.

The model is the "tiny" random-weight shape (bench/random_model.py: one layer, hidden 64, a
1,024-token LM head) so its forward costs almost nothing. Each decode step is timed as a whole
(`EngineCore.step()`), and so is the model's own work inside it (the forward and the LM head,
timed by wrapping them): the difference is the host's work per step, which on a GPU is what
the device waits for unless it overlaps. The offline `LLM`'s output processing (detokenization,
stop strings) is timed on its own: on a server it runs in the frontend process.

`--phase decode` (the default) times the steps in which every sequence decodes. `--phase
prefill` times the steps that complete prompts: by default 1,024 prompts of 16 tokens and one
output token each, so that a step under the default 2,048-token budget carries 128 prefill
chunks (the runner's per-chunk work: block tables, slots, the attention plan). Either way the
garbage collector's pauses inside the timed steps are recorded (`gc_ms` per step, from
`gc.callbacks`), with the slowest steps (`step_p99_ms`, `step_max_ms`): where the build's
engine process freezes its start-up heap (`common.process_args.freeze_startup_heap`), the
workload does too once its engine is built.

`--baseline REF` measures a git commit the same way in the same run (from a temporary
worktree, in a child process): the before/after that docs/performance.md quotes. The measurement
below therefore uses only interfaces every commit has (EngineCore, OutputProcessor). The
two builds' runs alternate (baseline, current, baseline, ...), each keeping its engine, so
that the VM's drift in speed (this project's 2-core VMs vary by 2x within minutes) falls on
both alike; each keeps its best run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

DEFAULT_SEQS = 256
# Per --phase: (sequences, prompt tokens, output tokens) unless given.
PHASE_DEFAULTS = {"decode": (DEFAULT_SEQS, 128, 64), "prefill": (1024, 16, 1)}
# The requests' sampling settings, by --sampling name (keyword arguments of SamplingParams;
# "seed" is replaced by a seed per request).
SAMPLING = {"greedy": {"temperature": 0.0}, "seeded": {"temperature": 0.8, "seed": 0}}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--phase", choices=sorted(PHASE_DEFAULTS), default="decode",
                   help="decode (default): time the steps in which every sequence decodes; prefill: time "
                        "the steps that complete prompts (default 1,024 prompts of 16 tokens, 1 output "
                        "token: 128 prefill chunks a step)")
    p.add_argument("--num-seqs", type=int, default=None,
                   help="concurrent sequences (default: 256; --phase prefill: 1,024)")
    p.add_argument("--input-len", type=int, default=None, help="prompt tokens (default: 128; prefill: 16)")
    p.add_argument("--output-len", type=int, default=None,
                   help="output tokens per sequence (default: 64; prefill: 1)")
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


class Workload:
    """One engine on the tiny model; each `run` adds the workload's requests and times them."""

    def __init__(self, model_dir: str, num_seqs: int, input_len: int, output_len: int, sampling: str = "greedy",
                 phase: str = "decode"):
        import torch

        from engine.config import EngineConfig
        from engine.core import EngineCore
        from engine.models.loader import eos_token_ids, load_tokenizer
        torch.set_flush_denormal(True)
        self.tokenizer = load_tokenizer(Path(model_dir))
        blocks = num_seqs * (-(-(input_len + output_len) // 16) + 1)
        config = EngineConfig(model=model_dir, dtype="float32", max_num_seqs=num_seqs, num_kv_blocks=blocks,
                              max_num_batched_tokens=max(2048, num_seqs), enable_prefix_caching=False)
        self.core = EngineCore(config, eos_token_ids(self.tokenizer), tokenizer=self.tokenizer)
        self.model_s = _time_model(self.core.model_runner.model)
        self.num_seqs, self.input_len, self.output_len = num_seqs, input_len, output_len
        self.settings = SAMPLING[sampling]
        self.phase = phase
        self.num_runs = 0
        self.gc = GcPauses()
        _freeze_startup_heap()

    def run(self, profile: bool = False) -> dict:
        from engine import SamplingParams  # (where both sides of --baseline have it)
        from frontend.output_processor import OutputProcessor
        processor = OutputProcessor(self.tokenizer, self.core.eos_token_ids)
        run, self.num_runs = self.num_runs, self.num_runs + 1
        self.gc.take_longest()  # (from here: adding the requests allocates too)
        for i in range(self.num_seqs):
            seed = {"seed": i} if "seed" in self.settings else {}
            params = SamplingParams(**{**self.settings, **seed}, max_tokens=self.output_len, ignore_eos=True)
            prompt = [100 + (i * 7 + j * 13) % 900 for j in range(self.input_len)]
            self.core.add_request(f"{run}-{i}", prompt, params)
            processor.add_request(f"{run}-{i}", prompt, params)
        return _timed_steps(self.core, processor, self.model_s, self.gc, self.num_seqs, self.phase, profile)

    def close(self) -> None:
        """Give the process its collector back as it was (a test process measures too)."""
        import gc
        gc.callbacks.remove(self.gc.callback)
        gc.unfreeze()


def measure(model_dir: str, num_seqs: int, input_len: int, output_len: int, repeats: int,
            profile: bool = False, sampling: str = "greedy", phase: str = "decode") -> dict:
    """Best-of-`repeats` per-step means over the timed steps (`phase`'s) of one workload."""
    workload = Workload(model_dir, num_seqs, input_len, output_len, sampling, phase)
    try:
        return best_of([workload.run(profile and run == repeats - 1) for run in range(repeats)])
    finally:
        workload.close()


def best_of(runs: list[dict]) -> dict:
    """The run with the least host time, and the longest GC pause of any run (a full
    collection comes once in several runs, in any step)."""
    best = min(runs, key=lambda r: r["host_ms"])
    return {**best, "runs": runs, "engine_file": sys.modules["engine"].__file__,
            "gc_pause_max_ms_any_run": max(r.get("gc_pause_max_ms", 0.0) for r in runs)}


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


class GcPauses:
    """The garbage collector's pauses, from `gc.callbacks`: `take()` returns the seconds spent
    collecting since its last call, `take_longest()` the longest single pause since its last."""

    def __init__(self) -> None:
        import gc
        self.spent_s, self.longest_s, self._start = 0.0, 0.0, 0.0
        gc.callbacks.append(self.callback)

    def callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            pause = time.perf_counter() - self._start
            self.spent_s += pause
            self.longest_s = max(self.longest_s, pause)

    def take(self) -> float:
        spent, self.spent_s = self.spent_s, 0.0
        return spent

    def take_longest(self) -> float:
        longest, self.longest_s = self.longest_s, 0.0
        return longest


def _freeze_startup_heap() -> None:
    """What the engine process does once it is ready, where this build's does it."""
    try:
        from common.process_args import freeze_startup_heap
    except ImportError:
        return
    freeze_startup_heap()


def _timed_steps(core, processor, model_s: list[float], gc_pauses: GcPauses, num_seqs: int, phase: str,
                 profile: bool) -> dict:
    """Step until done; time the steps of `phase`: decode, those in which every sequence
    decodes (all have a token); prefill, those that give prompts their first token."""
    started: set[str] = set()
    packed = hasattr(core, "step_packed")
    steps, step_s, forward_s, output_s, gc_s, step_times = 0, 0.0, 0.0, 0.0, 0.0, []
    profiler = None
    while core.has_unfinished_requests():
        decoding = len(started) == num_seqs
        if (decoding or phase == "prefill") and profile and profiler is None:
            import cProfile
            profiler = cProfile.Profile()
            profiler.enable()
        model_s[0] = 0.0
        gc_pauses.take()
        start = time.perf_counter()
        # What the engine process and the offline LLM call: step_packed where the build has it.
        outputs, plain = core.step_packed() if packed else (core.step(), None)
        stepped = time.perf_counter()
        processor.process_outputs(outputs, plain) if packed else processor.process_outputs(outputs)
        done = time.perf_counter()
        ids = [o.request_id for o in outputs] + (plain.request_ids if packed else [])
        if (phase == "prefill" and not started.issuperset(ids)) or (decoding and len(ids) == num_seqs):
            steps += 1
            step_times.append(stepped - start)
            step_s += stepped - start
            forward_s += model_s[0]
            output_s += done - stepped
            gc_s += gc_pauses.take()
        started.update(ids)
    if profiler is not None:
        import pstats
        profiler.disable()
        pstats.Stats(profiler).sort_stats("tottime").print_stats(45)
    return {**_per_step(steps, step_s, forward_s, output_s, gc_s, step_times),
            "gc_pause_max_ms": 1e3 * gc_pauses.take_longest()}


def _per_step(steps: int, step_s: float, forward_s: float, output_s: float, gc_s: float,
              step_times: list[float]) -> dict:
    steps = max(steps, 1)
    ordered = sorted(step_times) or [0.0]
    return {"steps": steps, "step_ms": 1e3 * step_s / steps, "forward_ms": 1e3 * forward_s / steps,
            "host_ms": 1e3 * (step_s - forward_s) / steps, "output_ms": 1e3 * output_s / steps,
            "gc_ms": 1e3 * gc_s / steps, "step_p99_ms": 1e3 * ordered[int(0.99 * (len(ordered) - 1))],
            "step_max_ms": 1e3 * ordered[-1]}


class Baseline:
    """Commit `ref`, checked out in a temporary worktree, measured by a child process that
    keeps one `Workload` and times one run per `run()` call (a line on its stdin, a JSON line
    back)."""

    def __init__(self, ref: str, args: argparse.Namespace, model_dir: Path) -> None:
        from bench.reporting import Worktree
        self.worktree = Worktree(ref)
        self.sha, self.tree = self.worktree.sha, self.worktree.tree
        cmd = [sys.executable, str(Path(__file__).resolve()), "--measure-only", "--model-dir", str(model_dir),
               "--num-seqs", str(args.num_seqs), "--input-len", str(args.input_len),
               "--output-len", str(args.output_len)]
        if args.phase != "decode":
            cmd += ["--phase", args.phase]
        if args.sampling != "greedy":  # (older commits know greedy only)
            cmd += ["--sampling", args.sampling]
        self.child = subprocess.Popen(cmd, cwd=self.tree, env={**os.environ, "PYTHONPATH": str(self.tree)},
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.engine_file = self._reply()["engine_file"]

    def run(self) -> dict:
        self.child.stdin.write("run\n")
        self.child.stdin.flush()
        return self._reply()

    def _reply(self) -> dict:
        line = self.child.stdout.readline()
        if not line:
            raise RuntimeError(f"the baseline's child process ({self.sha[:10]}) ended: exit {self.child.wait()}")
        return json.loads(line)

    def close(self) -> None:
        self.child.stdin.close()
        self.child.wait()
        self.worktree.close()


def measure_ref(ref: str, args: argparse.Namespace, model_dir: Path) -> dict:
    """`measure` of commit `ref`: best of `args.repeats` runs in a `Baseline` child."""
    baseline = Baseline(ref, args, model_dir)
    try:
        return {**best_of([baseline.run() for _ in range(args.repeats)]), "engine_file": baseline.engine_file,
                "commit": baseline.sha}
    finally:
        baseline.close()


def _serve_runs(args: argparse.Namespace) -> int:
    """The child of --baseline: the engine file, then one JSON line per line read."""
    workload = Workload(args.model_dir, args.num_seqs, args.input_len, args.output_len, args.sampling, args.phase)
    print(json.dumps({"engine_file": sys.modules["engine"].__file__}), flush=True)
    for _ in sys.stdin:
        print(json.dumps(workload.run()), flush=True)
    return 0


def _interleaved(args: argparse.Namespace, model_dir: Path, head: str) -> dict[str, dict]:
    """Both builds' runs in turn, baseline first (see the module's docstring)."""
    baseline = Baseline(args.baseline, args, model_dir)
    try:
        current = Workload(str(model_dir), args.num_seqs, args.input_len, args.output_len, args.sampling,
                           args.phase)
        base_runs, current_runs = [], []
        try:
            for run in range(args.repeats):
                base_runs.append(baseline.run())
                current_runs.append(current.run(args.profile and run == args.repeats - 1))
        finally:
            current.close()
    finally:
        baseline.close()
    return {"baseline": {**best_of(base_runs), "engine_file": baseline.engine_file, "commit": baseline.sha},
            "current": {**best_of(current_runs), "commit": head}}


def resolve_phase_defaults(args: argparse.Namespace) -> argparse.Namespace:
    """Sizes not given on the command line take their --phase's defaults."""
    args.phase = getattr(args, "phase", "decode")
    for name, default in zip(("num_seqs", "input_len", "output_len"), PHASE_DEFAULTS[args.phase]):
        if getattr(args, name, None) is None:
            setattr(args, name, default)
    return args


def run(args: argparse.Namespace) -> int:
    resolve_phase_defaults(args)
    if args.measure_only:
        return _serve_runs(args)
    from bench.reporting import RESULTS_DIR, machine_info, print_table, write_result
    from bench.plots import plot_host_step
    from bench.random_model import random_model_dir
    model_dir = random_model_dir("tiny", "float32")
    head = subprocess.check_output(["git", "-C", str(Path(__file__).resolve().parent.parent),
                                    "rev-parse", "HEAD"], text=True).strip()
    if args.baseline:
        results = _interleaved(args, model_dir, head)
    else:
        results = {"current": {**measure(str(model_dir), args.num_seqs, args.input_len, args.output_len,
                                         args.repeats, args.profile, args.sampling, args.phase), "commit": head}}
    rows = [[name, r["commit"][:10], f"{r['step_ms']:.2f}", f"{r['forward_ms']:.2f}", f"{r['host_ms']:.2f}",
             f"{r['output_ms']:.2f}", f"{r['gc_ms']:.3f}", f"{r['step_p99_ms']:.2f}", f"{r['step_max_ms']:.2f}",
             f"{r['gc_pause_max_ms_any_run']:.2f}"] for name, r in results.items()]
    print(f"per {args.phase} step:")
    print_table(["build", "commit", "step ms", "model ms", "host ms", "output ms", "gc ms", "p99 ms", "max ms",
                 "longest gc ms"], rows)
    ratios = {}
    if "baseline" in results:
        base, cur = results["baseline"], results["current"]
        ratios = {"host_ratio": cur["host_ms"] / base["host_ms"],
                  "output_ratio": cur["output_ms"] / base["output_ms"]}
        print(f"host time per step: {ratios['host_ratio']:.3f}x the baseline's "
              f"(1/{1 / ratios['host_ratio']:.1f}); output processing {ratios['output_ratio']:.3f}x")
    payload = {"machine": machine_info(),
               "workload": {"phase": args.phase, "num_seqs": args.num_seqs, "input_len": args.input_len,
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
