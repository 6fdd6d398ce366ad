"""Build every CPU kernel family now, so that the first engine start does not wait for the
compiler (about 20 s per family on two cores), then measure this machine's kernel plan for
the bundled model's shapes (cpu_kernels/dispatch.py: what `--dtype auto` means here; a few
seconds). `make setup` runs it. A family that cannot build is reported and skipped: the
engine then runs the plain-torch paths.

    python -m cpu_kernels.warm [--remeasure]
"""

from __future__ import annotations

import argparse
import sys
import time


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--strict", action="store_true", help="exit 1 if any family cannot build")
    parser.add_argument("--remeasure", action="store_true",
                        help="forget every cached kernel plan first and measure again (otherwise a cached plan is "
                             "only checked, and measured again if its winner no longer wins)")
    args = parser.parse_args(argv)
    from cpu_kernels.compile import FAMILIES, build_dir, unavailable_reason
    failed = 0
    for family in FAMILIES:
        start = time.perf_counter()
        reason = unavailable_reason(family)
        if reason is None:
            print(f"cpu_kernels: {family} ready in {time.perf_counter() - start:.1f} s ({build_dir(family)})")
        else:
            failed += 1
            print(f"cpu_kernels: {family} unavailable, the engine will use plain torch: {reason}",
                  file=sys.stderr)
    from cpu_kernels.dispatch import forget, machine_plan
    if args.remeasure:
        print(f"cpu_kernels: forgot {forget()} cached plan(s)")
    start = time.perf_counter()
    plan = machine_plan()
    if plan is not None:
        print(f"cpu_kernels: plan measured in {time.perf_counter() - start:.1f} s: {plan.reason()}")
    return 1 if failed and args.strict else 0


if __name__ == "__main__":
    sys.exit(main())
