#!/usr/bin/env bash
# The GPU sessions, each ONE device call of at most 10 minutes. From the repository root on the
# GPU machine:
#
#     bash bench/gpu_session.sh [kernels]    # the CuPy kernels (below); about 80 s on an H200
#     bash bench/gpu_session.sh throughput   # engine throughput on random weights (further below)
#     bash bench/gpu_session.sh throughput-cpu   # the same steps on CPU, tiny shape, tiny workload:
#                                                # checks the script itself on any machine (~2 min)
#     bash bench/gpu_session.sh quick        # a short lease (~4 min): below; quick-cpu checks it
#     bash bench/gpu_session.sh prefill      # long prompts (~5 min): below; prefill-cpu checks it
#
# Results and logs go under $OUT (default /tmp/pagedserve-gpu); summary.txt ends with a table.
#
# kernels:
# 1. compiles every kernel instantiation in parallel processes (CuPy's disk cache);
# 2. tests/kernels: each kernel against its float32 torch reference, the cupy backend
#    against the torch backend (the CPU-side tests run in CI, not here);
# 3. tests/kernels/test_gpu_e2e.py: our LLM on CUDA with the cupy backend, CUDA graphs on
#    and off, greedy against HF transformers on the same GPU; test_gpu_families.py: the
#    MoE, Phi-3 and Gemma 3 families and multi-LoRA the same way (peft is in the image);
# 4. `bench kernels` (python -m bench.kernels): copy bandwidth, decode bandwidth grid,
#    fixed and launch costs -> kernels-<stamp>.json and .png; then fewer shapes over an fp8
#    cache (--kv-cache-dtype fp8) -> fp8/kernels-<stamp>.json, timed against the bf16 ones;
# 5. compute-sanitizer memcheck and racecheck over a few kernel tests (an fp8 cache's too), in
#    the time left.
# It needs what the GPU image has (torch, cupy, transformers, pytest), no gguf, plus
# llguidance for the e2e step (the engine imports it; carry its wheel, docs/kernels.md).
# Afterwards: copy $OUT/kernels-*.json and $OUT/kernels-*.png into bench/results/ and
# commit them with the numbers in README and docs/kernels.md; the logs stay out of git.
#
# throughput: a random-weight qwen2.5-0.5b (bench/random_model.py: nothing to download),
# bf16, 1,024 requests x 128 prompt / 128 output tokens, greedy, eos ignored, at most 256
# sequences, a 20 GiB KV cache; most important numbers first, each step under a time limit:
# 1. build the random model folder (CPU, seconds); then tests/kernels/test_gpu_e2e.py (greedy
#    against HF on the GPU, async scheduling and CUDA graphs among its configs);
# 2. `bench offline --attention-backend cupy --compare-hf`, with --async-scheduling as every
#    engine step below unless it says otherwise: engine output tok/s, the
#    single-stream decode rate, HF generate (bf16, bs 1 on a few prompts and bs 256) on the
#    same GPU;
# 3. `bench gpu-busy` with async scheduling and without: the decode step's wall time, the
#    GPU's busy share and the bandwidth bound at 256 sequences;
# 4. one `pagedserve serve` (cupy), then `bench serve` at concurrency 256 over gRPC, and
#    over HTTP (--backend openai: streaming /completions) on fresh prompts (another seed);
#    then HTTP again from a server with --api-server-count 4;
# 5. step 2 again with --no-async-scheduling (no HF), then with `--attention-backend torch`;
# 6. in the time left, `bench gpu-busy` on a random llama-3-8b (weights built on the GPU).
# quick: the GPU tests of the layer kernels, the cupy backend (both prefill paths), test_gpu_e2e.py,
# test_gpu_families.py, test_gpu_vision.py (Qwen2.5-VL, Qwen3-VL, Gemma 3 with images), test_gpu_sleep.py and
# test_gpu_kv_offload.py (sleep and the second tier on CUDA); `bench gpu-busy` with the fused layer kernels, with --no-layer-kernels and with the
# tensor-core decode (PAGEDSERVE_CUPY_DECODE=mma); one server over gRPC and HTTP, one with
# --api-server-count 4 over HTTP, one with --async-admission-steps 0 over gRPC; one offline
# run. The same workload as throughput.
# prefill: the cupy backend against the torch one, GPU tests first; then prompt tok/s on 32 prompts
# of 2,048 tokens and 8 of 8,192 (output 1 token: all prefill, chunked by the 2,048-token budget)
# with the cupy backend's FlashAttention prefill, its paged_prefill kernel
# (PAGEDSERVE_CUPY_PREFILL=paged) and the torch backend (SDPA), same model as throughput.
# Besides the image it needs these wheels (cp312, manylinux x86-64; docs/kernels.md says how to
# fetch and carry them): llguidance pyzmq grpcio grpcio-health-checking grpcio-reflection
# protobuf fastapi starlette pydantic pydantic-core annotated-types typing-inspection uvicorn
# annotated-doc opentelemetry-api typing-extensions pillow, at the versions of the dev environment.
# With them in .whl/ (carried), the script installs them into /tmp/site itself; if the imports
# fail it stops at once. Afterwards: unpack $OUT/results.tar (the JSONs) into bench/results/,
# draw the chart (python -m bench.throughput_report --plot PNG JSON...) and commit them; the
# logs stay out of git.
#
# PYTHONPATH=. puts the repository on the path.
set -uo pipefail
cd "$(dirname "$0")/.."
MODE=${1:-kernels}
case $MODE in
  kernels|throughput|throughput-cpu|quick|quick-cpu|prefill|prefill-cpu) ;;
  *) echo "usage: bash bench/gpu_session.sh [kernels|throughput|throughput-cpu|quick|quick-cpu|prefill|prefill-cpu]" >&2
     exit 2 ;;
esac
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

if compgen -G ".whl/*.whl" > /dev/null; then  # carried wheels (see above)
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl/*.whl && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi

kernels_session() {
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
  tests/kernels/test_{cache_kernel,decode_kernel,prefill_kernel,cupy_backend,gpu_flags,plan,reference,cuda_quant}.py
step e2e 150 "$OUT/e2e.log" $PYTEST tests/kernels/test_gpu_e2e.py tests/kernels/test_gpu_families.py
step bench 180 "$OUT/bench.log" $PY -m bench.kernels --output-dir "$OUT"
# The same decode cases over an fp8 cache (fewer shapes), beside the bf16 ones in the summary.
step bench-fp8 90 "$OUT/bench-fp8.log" $PY -m bench.kernels --kv-cache-dtype fp8 --batches 1,16,64,256 \
  --contexts 1024,8192 --output-dir "$OUT/fp8"
# One cudaMalloc per tensor, so that an out-of-bounds access lands outside any allocation.
export PYTORCH_NO_CUDA_MEMORY_CACHING=1
SAN="$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer) --error-exitcode 9 --print-limit 20"
step memcheck 90 "$OUT/sanitizer.log" $SAN --tool memcheck $PYTEST tests/kernels/test_decode_kernel.py \
  tests/kernels/test_prefill_kernel.py tests/kernels/test_cache_kernel.py -k "8q2kv and 128 and dtype2 or reshape and dtype2 and 300"
step racecheck 60 "$OUT/racecheck.log" $SAN --tool racecheck $PYTEST tests/kernels/test_decode_kernel.py \
  tests/kernels/test_prefill_kernel.py -k "8q2kv and 128 and 16 and dtype2"
# The fp8 cache's kernels (--kv-cache-dtype fp8: staging through registers, the quantizing write).
step memcheck-fp8 60 "$OUT/sanitizer-fp8.log" $SAN --tool memcheck $PYTEST tests/kernels/test_decode_kernel.py \
  tests/kernels/test_prefill_kernel.py tests/kernels/test_cache_kernel.py \
  -k "fp8_cache and bf16 and 8q2kv and -128- and (single or test_prefill) or reshape_and_cache_fp8 and 300 and bf16"
step racecheck-fp8 45 "$OUT/racecheck-fp8.log" $SAN --tool racecheck $PYTEST tests/kernels/test_decode_kernel.py \
  tests/kernels/test_prefill_kernel.py -k "fp8_cache and bf16 and 8q2kv and -16-128- and (single or test_prefill)"

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
def worst(heads, key="pct"):
    pts = [d[key] for d in rows if d["heads"] == heads and d["batch"] == 64 and d["context"] >= 1024]
    return min(pts) if pts else float("nan")
fixed = r["fixed_cost"]
print(f"\ncopy bandwidth            {r['copy_gb_s']:8.0f} GB/s")
for heads, target in (("MHA", 85), ("GQA8", 60)):
    v = worst(heads)
    print(f"{heads:<5} bs64 L>=1k, worst  {v:8.1f} %   target >= {target}%  {'ok' if v >= target else 'MISS'}")
    v = worst(heads, "mma_pct")
    print(f"{heads:<5} tensor cores        {v:8.1f} %   target >= {target}%  {'ok' if v >= target else 'MISS'}")
g = fixed["gpu_us_per_call"]
print(f"fixed cost (GPU)          {g:8.2f} us  target <= 10 us  {'ok' if g <= 10 else 'MISS'}")
for k, v in fixed["host_us_per_launch"].items():
    print(f"host launch, {k:<21} {v:6.1f} us")
fp8 = sorted(glob.glob(f"{out}/fp8/kernels-*.json"))
if fp8:  # each fp8 case's time against the bf16 cache's, same kernel choice
    base = {(d["heads"], d["batch"], d["context"]): d for d in rows}
    print("\nfp8 cache         chosen us   achieved  bf16/fp8 time   mma: bf16/fp8 time")
    for d in json.load(open(fp8[-1]))["results"]["decode"]:
        b, k = base.get((d["heads"], d["batch"], d["context"])), d.get("heuristic")
        if "pct" in d and b is not None and "pct" in b:
            print(f"{d['heads']:<5} bs{d['batch']:<4} L{d['context']:<5} {d[k + '_us']:8.1f} {d['pct']:8.1f} %"
                  f"  {b[k + '_us'] / d[k + '_us']:8.2f}x  {b['mma_us'] / d['mma_us']:12.2f}x")
PYEOF
}

# The throughput sessions' shared settings and steps (globals: set by `sizes`).
sizes() {  # the workload: the H100's, or a tiny one for a CPU (the *-cpu modes check the script)
  shape=qwen2.5-0.5b device=cuda backend=cupy dtype=bfloat16 n=1024 len=128 seqs=256 kv=20
  if [[ $MODE == *-cpu ]]; then shape=tiny device=cpu backend=cpu dtype=float32 n=32 len=16 seqs=16 kv=0.25; fi
  res=/tmp/pagedserve-$MODE
  rm -rf "$res" && mkdir -p "$res"
  model=(--random-weights "$shape" --device "$device" --dtype "$dtype")
  engine=(--max-num-seqs "$seqs" --kv-cache-memory-gb "$kv" --async-scheduling)
  offline=(-m pagedserve bench offline "${model[@]}" "${engine[@]}" --num-prompts "$n" --input-len "$len"
           --output-len "$len")
  serve=(-m pagedserve bench serve "${model[@]}" --num-prompts "$n" --random-input-len "$len"
         --random-output-len "$len" --max-concurrency "$seqs" --output-dir "$res/serve")
  busy=(-m pagedserve bench gpu-busy --random-weights "$shape" --device "$device" --dtype "$dtype"
        --attention-backend "$backend" --num-seqs "$seqs" --input-len "$len" --kv-cache-memory-gb "$kv"
        --output-dir "$res/gpu-busy")
  {
    date -u
    command -v nvidia-smi > /dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    echo "mode $MODE: $shape $dtype on $device, $n requests x $len in / $len out, $seqs seqs, KV $kv GiB"
  } > "$OUT/summary.txt" 2>&1
}

first_steps() {  # imports (stop at once if they fail: a missing wheel), then the model folder
  step imports 60 "$res/imports.log" $PY -c "import llguidance, zmq, grpc_health, grpc_reflection, fastapi, uvicorn
import pagedserve.llm, frontend.server; print('imports ok')"
  if ! grep -q "imports ok" "$res/imports.log"; then
    cat "$res/imports.log" >> "$OUT/summary.txt"; return 1
  fi
  step build 150 "$res/build.log" $PY -c "from bench.random_model import random_model_dir
print(random_model_dir('$shape', '$dtype'))"
}

serve_with() {  # serve_with SUFFIX "grpc http" [SERVER FLAGS...]: one server, bench serve over those APIs
  local suffix=$1 apis=$2; shift 2
  local grpc_port http_port engine_port
  read -r grpc_port http_port engine_port < <($PY -c "from bench.servers import free_port as f; print(f(), f(), f())")
  $PY -m pagedserve serve --model "$(tail -n 1 "$res/build.log")" --dtype "$dtype" --device "$device" \
    --attention-backend "$backend" "${engine[@]}" --max-concurrent-streams "$n" --grpc-port "$grpc_port" \
    --http-port "$http_port" --engine-address "tcp://127.0.0.1:$engine_port" "$@" > "$res/server$suffix.log" 2>&1 &
  local server=$!
  step "server-up$suffix" 150 "$res/server-up$suffix.log" bash -c "until $PY -m pagedserve health --address \
    127.0.0.1:$grpc_port --service pagedserve.v1.Generation; do kill -0 $server || exit 1; sleep 1; done"
  [[ $apis == *grpc* ]] && step "serve-grpc$suffix" 150 "$res/serve-grpc$suffix.log" $PY "${serve[@]}" \
    --target "127.0.0.1:$grpc_port" --label "grpc$suffix"
  [[ $apis == *http* ]] && step "serve-http$suffix" 150 "$res/serve-http$suffix.log" $PY "${serve[@]}" \
    --backend openai --label "http$suffix" --seed 1 --target "http://127.0.0.1:$http_port/v1"
  kill -TERM "$server" 2> /dev/null
  timeout 40 tail --pid "$server" -f /dev/null || kill -KILL "$server" 2> /dev/null
}

finish() {  # at most 8 files come back from a device call: the JSONs in one tar, a summary, one file of logs
  mkdir -p "$res/json"
  cp "$res"/offline-*/offline-*.json "$res"/serve/serve-*.json "$res"/gpu-busy/gpu-busy-*.json "$res/json"/ 2> /dev/null
  (cd "$res/json" && tar -cf "$OUT/results.tar" ./*.json)
  for log in "$res"/*.log; do  # no progress bars
    echo "=== $(basename "$log")"; tr '\r' '\n' < "$log" | grep -a -v -E '[0-9]+/[0-9]+ \[' | cat -s | tail -n 40
  done > "$OUT/throughput-logs.txt"
  $PY -m bench.throughput_report "$res/json" "$STEPS" | tee -a "$OUT/summary.txt"
}

throughput_session() {  # see the header: the most important numbers first
  local repeats=3 hf=(--hf-dtypes bfloat16 --hf-batch-size 256 --hf-sequential-prompts 8)
  sizes
  if [[ $MODE == *-cpu ]]; then repeats=1 hf=(--hf-dtypes float32 --hf-batch-size 16 --hf-sequential-prompts 2); fi
  first_steps || { finish; return 1; }
  # Correctness before speed: our engine against HF on this GPU, the async-scheduling config too.
  step e2e 120 "$res/e2e.log" $PY -m pytest -q -rfE -p no:cacheprovider tests/kernels/test_gpu_e2e.py
  step "offline-$backend" 240 "$res/offline-$backend.log" $PY "${offline[@]}" --attention-backend "$backend" \
    --repeats "$repeats" --single-repeats 5 --compare-hf "${hf[@]}" --output-dir "$res/offline-$backend"
  # Async scheduling against the synchronous loop, same run (on a CPU both run synchronously).
  step gpu-busy 90 "$res/gpu-busy.log" $PY "${busy[@]}" --async-scheduling
  step gpu-busy-sync 90 "$res/gpu-busy-sync.log" $PY "${busy[@]}" --no-async-scheduling
  serve_with "" "grpc http"  # one server for both APIs: one start (model load, CUDA graphs) instead of two
  # HTTP from 4 frontend processes (one port): whether one frontend's core is HTTP's limit.
  serve_with "-4fe" "http" --api-server-count 4
  step "offline-$backend-sync" 120 "$res/offline-$backend-sync.log" $PY "${offline[@]}" --attention-backend \
    "$backend" --no-async-scheduling --repeats 1 --single-repeats 3 --output-dir "$res/offline-$backend-sync"
  step offline-torch 150 "$res/offline-torch.log" $PY "${offline[@]}" --attention-backend torch \
    --repeats 1 --single-repeats 3 --output-dir "$res/offline-torch"
  # Last, in the time left: the loop at production size (its random weights built on the GPU).
  [[ $MODE == throughput ]] && step gpu-busy-8b 300 "$res/gpu-busy-8b.log" $PY -m pagedserve bench gpu-busy \
    --random-weights llama-3-8b --device cuda --dtype bfloat16 --attention-backend cupy --num-seqs 256 \
    --input-len "$len" --kv-cache-memory-gb 30 --output-dir "$res/gpu-busy"
  finish
}

quick_session() {  # a short lease: this change's correctness, then its A/Bs, each in the same run
  sizes
  first_steps || { finish; return 1; }
  step kernel-tests 180 "$res/kernel-tests.log" $PY -m pytest -q -rfE -p no:cacheprovider \
    tests/kernels/test_layer_kernel.py tests/kernels/test_cupy_backend.py tests/kernels/test_gpu_e2e.py \
    tests/kernels/test_gpu_families.py tests/kernels/test_gpu_vision.py tests/kernels/test_gpu_sleep.py \
    tests/kernels/test_gpu_kv_offload.py
  step gpu-busy 60 "$res/gpu-busy.log" $PY "${busy[@]}"
  step gpu-busy-eager 60 "$res/gpu-busy-eager.log" $PY "${busy[@]}" --no-layer-kernels
  step gpu-busy-mma 60 "$res/gpu-busy-mma.log" env PAGEDSERVE_CUPY_DECODE=mma $PY "${busy[@]}"
  serve_with "" "grpc http"
  serve_with "-4fe" "http" --api-server-count 4
  serve_with "-admit0" "grpc" --async-admission-steps 0
  step offline 90 "$res/offline.log" $PY "${offline[@]}" --attention-backend "$backend" --repeats 1 \
    --single-repeats 3 --output-dir "$res/offline-$backend"
  finish
}

prefill_session() {  # long prompts: the prefill kernels against each other and the torch backend
  sizes
  first_steps || { finish; return 1; }
  step kernel-tests 90 "$res/kernel-tests.log" $PY -m pytest -q -rfE -p no:cacheprovider \
    tests/kernels/test_cupy_backend.py tests/kernels/test_flash_prefill_plan.py
  local runs=("2048 32" "8192 8")
  [[ $MODE == *-cpu ]] && runs=("64 4")
  local run len prompts
  for run in "${runs[@]}"; do
    read -r len prompts <<< "$run"
    local long=(-m pagedserve bench offline "${model[@]}" --max-num-seqs "$prompts" --kv-cache-memory-gb "$kv"
                --max-model-len $((len + 256)) --num-prompts "$prompts" --input-len "$len" --output-len 1
                --repeats 2 --single-repeats 1)
    step "prefill-$len-flash" 90 "$res/prefill-$len-flash.log" env PAGEDSERVE_CUPY_PREFILL=flash $PY "${long[@]}" \
      --attention-backend "$backend" --output-dir "$res/offline-prefill-$len-flash"
    step "prefill-$len-paged" 90 "$res/prefill-$len-paged.log" env PAGEDSERVE_CUPY_PREFILL=paged $PY "${long[@]}" \
      --attention-backend "$backend" --output-dir "$res/offline-prefill-$len-paged"
    step "prefill-$len-torch" 90 "$res/prefill-$len-torch.log" $PY "${long[@]}" --attention-backend torch \
      --output-dir "$res/offline-prefill-$len-torch"
  done
  finish
}

case $MODE in
  kernels) kernels_session ;;
  quick|quick-cpu) quick_session ;;
  prefill|prefill-cpu) prefill_session ;;
  *) throughput_session ;;
esac
rm -f "$STEPS"
