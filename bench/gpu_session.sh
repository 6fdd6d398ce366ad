#!/usr/bin/env bash
# The GPU session for the CuPy kernels, in ONE device call of at most 10 minutes.
# From the repository root on the GPU machine:
#
#     bash bench/gpu_session.sh            # writes under $OUT (default /tmp/pagedserve-gpu)
#
# 1. compiles every kernel instantiation in parallel processes (CuPy's disk cache);
# 2. tests/kernels: each kernel against its float32 torch reference, the cupy backend
#    against the torch backend (the CPU-side tests run in CI, not here);
# 3. tests/kernels/test_gpu_e2e.py: our LLM on CUDA with the cupy backend, CUDA graphs on
#    and off, greedy against HF transformers on the same GPU; test_gpu_families.py: the
#    MoE, Phi-3 and Gemma 3 families and multi-LoRA the same way (peft is in the image);
# 4. `bench kernels` (python -m bench.kernels): copy bandwidth, decode bandwidth grid,
#    fixed and launch costs -> kernels-<stamp>.json and .png;
# 5. compute-sanitizer memcheck and racecheck over a few kernel tests, in the time left;
# then prints a short table (summary.txt).
#
# It needs what the GPU image has (torch, cupy, transformers, pytest), no gguf, plus
# llguidance for the e2e step (the engine imports it; carry its wheel, docs/kernels.md).
# PYTHONPATH=. puts the repository on the path.
# Afterwards: copy $OUT/kernels-*.json and $OUT/kernels-*.png into bench/results/ and
# commit them with the numbers in README and docs/kernels.md; the logs stay out of git.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/pagedserve-gpu}
mkdir -p "$OUT"
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
BUDGET_S=${BUDGET_S:-570}  # leave the device call's 600 s some slack
STEPS=$(mktemp)

step() {  # step NAME LIMIT_S LOG COMMAND...: run under a time limit, record its outcome
  local name=$1 limit=$2 log=$3; shift 3
  local left=$((BUDGET_S - SECONDS))
  (( limit > left )) && limit=$left
  if (( limit < 10 )); then echo "$name|skipped|0|no time left" >> "$STEPS"; return; fi
  local t0=$SECONDS
  timeout "$limit" "$@" > "$log" 2>&1
  local rc=$?
  echo "$name|$rc|$((SECONDS - t0))|$(grep -a -v '^\s*$' "$log" | tail -n 1 | cut -c1-90)" >> "$STEPS"
}

{
  date -u
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv
  $PY -c "import torch, cupy, transformers; print('torch', torch.__version__, 'cupy', cupy.__version__,
'transformers', transformers.__version__, torch.cuda.get_device_name(), torch.cuda.get_device_capability())"
} > "$OUT/summary.txt" 2>&1

XDIST=""
$PY -c "import xdist" 2>/dev/null && XDIST="-n 8"
PYTEST="$PY -m pytest -q -rfE -p no:cacheprovider --timeout 300"

step warm 120 /tmp/pagedserve-warm.log $PY -m cupy_kernels.warm --jobs 16
# The GPU kernel tests only: the CPU kernels' tests (and their C++ builds) run in CI.
step kernel-tests 240 "$OUT/kernel_tests.log" $PYTEST $XDIST --maxfail 40 \
  tests/kernels/test_{cache_kernel,decode_kernel,prefill_kernel,cupy_backend,gpu_flags,plan,reference}.py
step e2e 150 "$OUT/e2e.log" $PYTEST tests/kernels/test_gpu_e2e.py tests/kernels/test_gpu_families.py
step bench 180 "$OUT/bench.log" $PY -m bench.kernels --output-dir "$OUT"
# One cudaMalloc per tensor, so that an out-of-bounds access lands outside any allocation.
export PYTORCH_NO_CUDA_MEMORY_CACHING=1
SAN="$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer) --error-exitcode 9 --print-limit 20"
step memcheck 90 "$OUT/sanitizer.log" $SAN --tool memcheck $PYTEST tests/kernels/test_decode_kernel.py \
  tests/kernels/test_prefill_kernel.py tests/kernels/test_cache_kernel.py -k "8q2kv and 128 and dtype2 or reshape and dtype2 and 300"
step racecheck 60 "$OUT/racecheck.log" $SAN --tool racecheck $PYTEST tests/kernels/test_decode_kernel.py \
  tests/kernels/test_prefill_kernel.py -k "8q2kv and 128 and 16 and dtype2"

$PY - "$OUT" "$STEPS" <<'PYEOF' | tee -a "$OUT/summary.txt"
import glob, json, sys
out, steps = sys.argv[1], sys.argv[2]
print(f"\n{'step':<13} {'rc':>7} {'s':>4}  last line")
for line in open(steps):
    name, rc, secs, last = line.rstrip("\n").split("|", 3)
    print(f"{name:<13} {rc:>7} {secs:>4}  {last}")
files = sorted(glob.glob(f"{out}/kernels-*.json"))
if not files:
    sys.exit("\nno kernels JSON: see bench.log")
r = json.load(open(files[-1]))["results"]
rows = [d for d in r["decode"] if "pct" in d]
def worst(heads):
    pts = [d["pct"] for d in rows if d["heads"] == heads and d["batch"] == 64 and d["context"] >= 1024]
    return min(pts) if pts else float("nan")
fixed = r["fixed_cost"]
print(f"\ncopy bandwidth            {r['copy_gb_s']:8.0f} GB/s")
for heads, target in (("MHA", 85), ("GQA8", 60)):
    v = worst(heads)
    print(f"{heads:<5} bs64 L>=1k, worst  {v:8.1f} %   target >= {target}%  {'ok' if v >= target else 'MISS'}")
g = fixed["gpu_us_per_call"]
print(f"fixed cost (GPU)          {g:8.2f} us  target <= 10 us  {'ok' if g <= 10 else 'MISS'}")
for k, v in fixed["host_us_per_launch"].items():
    print(f"host launch, {k:<21} {v:6.1f} us")
PYEOF
rm -f "$STEPS"
