"""`python -m bench.engine_startup`: how long the engine takes to build on the bundled model.

Each run is a fresh process that imports the engine and loads the tokenizer (timed apart),
then times `EngineCore(...)`: the model built on the meta device, its weights allocated and
read, the KV cache, the kernels' warm-up. With --pythonpath, a second tree (e.g. a copy or a
git worktree of an older commit) is measured the same way, its runs alternating with this
tree's; each keeps its best run. (A git worktree of another commit is a fair baseline only
where nothing the engine caches per source tree differs; a copy of this tree with the change
undone is the surest.)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--runs", type=int, default=5, help="start-ups per tree; the best is kept (default: 5)")
    p.add_argument("--pythonpath", default=None, metavar="TREE", help="also measure this source tree, alternating")
    p.add_argument("--num-kv-blocks", type=int, default=256, help="KV blocks of the engine (default: 256)")
    p.add_argument("--output-dir", default=None, help="where to write JSON (default: bench/results)")
    p.add_argument("--measure-only", action="store_true", help=argparse.SUPPRESS)  # internal: one run


def measure(num_kv_blocks: int) -> dict:
    """One start-up in this process: seconds to import and load the tokenizer, then to build."""
    start = time.perf_counter()
    from engine.config import EngineConfig
    from engine.core import EngineCore
    from engine.models.loader import eos_token_ids, load_tokenizer
    from engine.models.source import bundled_model_path
    path = bundled_model_path()
    tokenizer = load_tokenizer(path)
    imported = time.perf_counter()
    EngineCore(EngineConfig(model=str(path), num_kv_blocks=num_kv_blocks), eos_token_ids(tokenizer),
               tokenizer=tokenizer)
    return {"import_s": imported - start, "engine_core_s": time.perf_counter() - imported,
            "engine_file": sys.modules["engine"].__file__}


def _run_in(tree: Path, args: argparse.Namespace) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--measure-only", "--num-kv-blocks", str(args.num_kv_blocks)]
    out = subprocess.run(cmd, cwd=tree, env={**os.environ, "PYTHONPATH": str(tree)}, check=True,
                         capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def run(args: argparse.Namespace) -> int:
    if args.measure_only:
        print(json.dumps(measure(args.num_kv_blocks)))
        return 0
    from bench.reporting import RESULTS_DIR, machine_info, print_table, write_result
    trees = {"current": ROOT, **({"baseline": Path(args.pythonpath).resolve()} if args.pythonpath else {})}
    runs: dict[str, list[dict]] = {name: [] for name in trees}
    for _ in range(args.runs):
        for name in sorted(trees):  # baseline first, as the other benchmarks' --baseline
            runs[name].append(_run_in(trees[name], args))
    results = {name: {**min(r, key=lambda x: x["engine_core_s"]), "tree": str(trees[name]), "runs": r}
               for name, r in runs.items()}
    print_table(["build", "tree", "EngineCore s (best)", "imports s"],
                [[n, r["tree"], f"{r['engine_core_s']:.3f}", f"{r['import_s']:.2f}"] for n, r in results.items()])
    payload = {"machine": machine_info(), "workload": {"model": "bundled", "num_kv_blocks": args.num_kv_blocks},
               "results": results}
    path = write_result("engine-startup", payload, Path(args.output_dir) if args.output_dir else RESULTS_DIR)
    print(f"wrote {path}")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return run(parser.parse_args())


if __name__ == "__main__":
    sys.exit(main())
