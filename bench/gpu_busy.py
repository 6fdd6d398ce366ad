"""`pagedserve bench gpu-busy`: how busy the GPU is during the decode phase at 256 concurrent
sequences, and how far a decode step is from its memory-bandwidth bound.

The engine runs a random-weight model (bench/random_model.py) through `EngineCore.step_packed()`,
as the offline `LLM` and the engine process do, with the offline output processor after each step.
Two passes over the same workload:
- **timed**: the wall time of each decode step (every sequence has its first token), of the
  engine step and of output processing apart;
- **profiled**: the same steps under torch.profiler with CUDA activity only (CUPTI): the sum of
  the kernels' and copies' device time over the decode phase's wall time is the GPU-busy share,
  and the kernels that take most of it are listed.
  The profiler adds a little host time, so the share it gives is, if anything, low.

The bound of a step is the bytes it must read (every weight once, plus each sequence's K and V
up to its position) over the copy bandwidth measured in the same run (a device-to-device copy,
bytes read plus written). A step's GPU time within 1.3x of it means the kernels are near the
hardware; the wall time within 1.3x of it means the host loop is out of the way too.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path


def add_arguments(p: argparse.ArgumentParser) -> None:
    from bench.random_model import SHAPES
    p.add_argument("--random-weights", default="qwen2.5-0.5b", choices=list(SHAPES), metavar="SHAPE",
                   help="the model: a random-weight shape (default: qwen2.5-0.5b)")
    p.add_argument("--device", default="cuda", help="device (default: cuda; cpu runs the steps without a profile)")
    p.add_argument("--dtype", default="auto", help="weights' dtype (default: bfloat16 on CUDA, float32 on CPU)")
    p.add_argument("--attention-backend", default="auto", help="attention backend (default: auto)")
    p.add_argument("--num-seqs", type=int, default=256, help="concurrent sequences (default: 256)")
    p.add_argument("--input-len", type=int, default=128, help="prompt tokens (default: 128)")
    p.add_argument("--output-len", type=int, default=64, help="output tokens per sequence (default: 64)")
    p.add_argument("--kv-cache-memory-gb", type=float, default=20.0, help="KV cache budget (default: 20)")
    p.add_argument("--async-scheduling", default=None, action=argparse.BooleanOptionalAction,
                   help="launch decode steps one ahead (default: the engine's: on with CUDA graphs)")
    p.add_argument("--layer-kernels", default=True, action=argparse.BooleanOptionalAction,
                   help="the decoder's fused norm/rotary/activation kernels (default: on)")
    p.add_argument("--output-dir", default=None, help="where to write JSON (default: bench/results)")


def run(args: argparse.Namespace) -> int:
    import torch

    from bench.reporting import RESULTS_DIR, machine_info, print_table, write_result
    from bench.random_model import random_model_dir, random_weights_dtype
    from engine.config import EngineConfig
    from engine.core import EngineCore
    from engine.models.loader import eos_token_ids, load_tokenizer
    torch.set_flush_denormal(True)
    dtype = random_weights_dtype(args.dtype, args.device)
    model_dir = random_model_dir(args.random_weights, dtype, device=args.device)
    tokenizer = load_tokenizer(model_dir)
    config = EngineConfig(model=str(model_dir), dtype=dtype, device=args.device,
                          attention_backend=args.attention_backend, max_num_seqs=args.num_seqs,
                          kv_cache_memory_gb=args.kv_cache_memory_gb, enable_prefix_caching=False,
                          max_num_batched_tokens=max(8192, args.num_seqs),
                          max_model_len=args.input_len + args.output_len + 16,
                          async_scheduling=args.async_scheduling, layer_kernels=args.layer_kernels)
    core = EngineCore(config, eos_token_ids(tokenizer), tokenizer=tokenizer)
    workload = _Workload(core, tokenizer, args.num_seqs, args.input_len, args.output_len)
    workload.run("warm-up", profile=False)  # kernels compiled, caches and graphs warm
    timed = workload.run("timed", profile=False)
    profiled = workload.run("profiled", profile=args.device.startswith("cuda"))
    bound = _bandwidth_bound(core, args, torch)
    result = {"timed": timed, "profiled": profiled, **bound}
    if profiled.get("gpu_ms") is not None:
        result["gpu_busy"] = profiled["gpu_ms"] / profiled["step_ms"]
        result["gpu_ms_over_bound"] = profiled["gpu_ms"] / bound["bound_ms"]
    result["step_ms_over_bound"] = timed["step_ms"] / bound["bound_ms"]
    rows = [["decode step, wall", f"{timed['step_ms']:.3f}"],
            ["  of which engine.step()", f"{timed['engine_ms']:.3f}"],
            ["  of which output processing", f"{timed['output_ms']:.3f}"],
            ["decode output tok/s", f"{timed['decode_tok_s']:.0f}"],
            ["bandwidth bound of a step", f"{bound['bound_ms']:.3f}"],
            ["step wall / bound", f"{result['step_ms_over_bound']:.2f}"]]
    if "gpu_busy" in result:
        rows += [["GPU time per step (profiled)", f"{profiled['gpu_ms']:.3f}"],
                 ["GPU busy share of the decode phase", f"{100 * result['gpu_busy']:.1f}%"],
                 ["GPU time / bound", f"{result['gpu_ms_over_bound']:.2f}"]]
    print_table(["measure (ms unless named)", "value"], rows)
    if profiled.get("top_kernels"):
        print_table(["kernel (profiled)", "ms / step", "calls / step"],
                    [[k["name"][:70], f"{k['ms_per_step']:.3f}", f"{k['calls_per_step']:.1f}"]
                     for k in profiled["top_kernels"]])
    payload = {"machine": machine_info(), "device": _device_name(args.device, torch),
               "workload": {"model": f"random {args.random_weights} ({dtype})", "num_seqs": args.num_seqs,
                            "input_len": args.input_len, "output_len": args.output_len,
                            "attention_backend": core.model_runner.backend.name,
                            "cuda_graphs": core.model_runner.graphs is not None,
                            "async_scheduling": core.async_scheduling,
                            "layer_kernels": any(getattr(m, "kernels", None) is not None
                                                 for m in core.model_runner.model.modules())},
               "results": result}
    path = write_result("gpu-busy", payload, Path(args.output_dir) if args.output_dir else RESULTS_DIR)
    print(f"wrote {path}")
    return 0


class _Workload:
    """`num_seqs` prompts added at once, stepped to the end; decode steps measured."""

    def __init__(self, core, tokenizer, num_seqs: int, input_len: int, output_len: int):
        self.core, self.tokenizer = core, tokenizer
        self.num_seqs, self.input_len, self.output_len = num_seqs, input_len, output_len

    def run(self, name: str, profile: bool) -> dict:
        import torch

        from common.sampling_params import SamplingParams
        from frontend.output_processor import OutputProcessor
        params = SamplingParams(temperature=0.0, max_tokens=self.output_len, ignore_eos=True)
        processor = OutputProcessor(self.tokenizer, self.core.eos_token_ids)
        vocab = min(self.tokenizer.vocab_size, 1000)
        for i in range(self.num_seqs):
            prompt = [10 + (i * 7 + j * 13 + 97 * len(name)) % (vocab - 10) for j in range(self.input_len)]
            self.core.add_request(f"{name}-{i}", prompt, params)
            processor.add_request(f"{name}-{i}", prompt, params)
        started: set[str] = set()
        steps, engine_s, output_s, phase_start, profiler = 0, 0.0, 0.0, None, None
        while self.core.has_unfinished_requests():
            decoding = len(started) == self.num_seqs
            if decoding and phase_start is None:
                if profile:
                    profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
                    profiler.start()
                phase_start = time.perf_counter()
            start = time.perf_counter()
            # Ends with the sampled ids on the host (the GPU is done with the step, or with async
            # scheduling the next is already on it); plain tokens packed, as the engine process has them.
            outputs, plain = self.core.step_packed()
            stepped = time.perf_counter()
            processor.process_outputs(outputs, plain)
            done = time.perf_counter()
            ids = [o.request_id for o in outputs] + plain.request_ids
            if decoding and len(ids) == self.num_seqs:
                steps, engine_s, output_s = steps + 1, engine_s + stepped - start, output_s + done - stepped
            started.update(ids)
        phase_s = time.perf_counter() - phase_start
        steps = max(steps, 1)
        result = {"decode_steps": steps, "step_ms": 1e3 * phase_s / steps, "engine_ms": 1e3 * engine_s / steps,
                  "output_ms": 1e3 * output_s / steps, "decode_tok_s": steps * self.num_seqs / phase_s}
        if profiler is not None:
            profiler.stop()
            result.update(_device_time(profiler.key_averages(), steps))
        return result


def _device_time(events, steps: int, top: int = 15) -> dict:
    """Per decode step: the device time of all kernels and copies, and the `top` kernels by
    device time (name, ms per step, launches per step), where the next GPU work is."""
    def device_us(e) -> float:
        return getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0))
    ranked = sorted(events, key=device_us, reverse=True)
    return {"gpu_ms": sum(map(device_us, events)) / 1e3 / steps,
            "top_kernels": [{"name": e.key[:120], "ms_per_step": device_us(e) / 1e3 / steps,
                             "calls_per_step": e.count / steps} for e in ranked[:top] if device_us(e) > 0]}


def _bandwidth_bound(core, args: argparse.Namespace, torch) -> dict:
    """Bytes a mean decode step reads (weights once, K and V to each position) and the copy
    bandwidth: their quotient is the step's least possible time."""
    model = core.model_runner.model
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    caches = core.model_runner.kv_caches  # per layer: (2, kv heads, blocks, block size, head dim)
    runner = core.model_runner
    per_token = caches[0].numel() * caches[0].element_size() // (runner.num_kv_blocks * runner.block_size)
    mean_context = args.input_len + args.output_len / 2
    kv_bytes = per_token * len(caches) * mean_context * args.num_seqs
    bandwidth = _copy_bandwidth(args.device, torch)
    return {"weight_bytes": weight_bytes, "kv_bytes_per_step": kv_bytes, "copy_gb_s": bandwidth / 1e9,
            "bound_ms": 1e3 * (weight_bytes + kv_bytes) / bandwidth}


def _copy_bandwidth(device: str, torch) -> float:
    """Bytes per second of a 1 GiB device copy (64 MiB on a CPU), read plus written, best of 12."""
    src = torch.empty(1 << (29 if device.startswith("cuda") else 25), dtype=torch.int16, device=device)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(12):
        _sync(device, torch)
        start = time.perf_counter()
        dst.copy_(src)
        _sync(device, torch)
        best = min(best, time.perf_counter() - start)
    return 2 * src.numel() * src.element_size() / best


def _sync(device: str, torch) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _device_name(device: str, torch) -> str:
    return torch.cuda.get_device_name() if device.startswith("cuda") else "cpu"
