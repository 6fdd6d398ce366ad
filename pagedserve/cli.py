"""The `pagedserve` command: one entry point, a subcommand per tool."""

from __future__ import annotations

import argparse
import os
import sys

from common.errors import ModelError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pagedserve", description="pagedserve: an LLM serving engine with a paged KV cache.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    from engine.main import add_arguments as add_engine
    from frontend.main import add_arguments as add_frontend
    from pagedserve.serve import add_arguments as add_serve
    add_serve(commands.add_parser(
        "serve", help="engine + gRPC frontend as two processes (the bundled model by default)",
        usage="%(prog)s [MODEL] [options]",
        description="Start the engine and the gRPC frontend as two processes, on MODEL (or --model): a "
                    "Hugging Face Hub repo id, downloaded into the Hub's cache unless there already, or a "
                    "local folder or .gguf file; the bundled SmolLM2 if none is given. Ctrl-C or SIGTERM "
                    "drains (running streams finish, new ones get UNAVAILABLE), then stops both."))
    add_engine(commands.add_parser(
        "engine", help="the engine process alone, serving frontends over ZeroMQ",
        description="Run the engine alone: it binds a ZeroMQ endpoint that frontends connect to."))
    add_frontend(commands.add_parser(
        "frontend", help="the gRPC frontend alone, connected to one or more running engines",
        description="Run the gRPC frontend alone, connected over ZeroMQ to an engine, or to several "
                    "(--engine-address repeated, or --engine-dns) among which it routes each request "
                    "(--routing-policy)."))
    from pagedserve.run_batch import add_arguments as add_run_batch
    add_run_batch(commands.add_parser(
        "run-batch", help="run a file of requests in OpenAI's batch format offline, through one engine",
        description="Run a JSONL file of requests in OpenAI's batch format ({custom_id, method, url, body} per "
                    "line; url /v1/chat/completions, /v1/completions or /v1/responses, or /v1/embeddings for an "
                    "embedding model) through one engine process and an in-process frontend, with no listener: "
                    "each line gets what the HTTP route would answer. Writes one result line per input line as it finishes ({id, custom_id, "
                    "response: {status_code, request_id, body}, error}); a bad line becomes an error line. "
                    "Exit code 0 once the file is processed. The engine flags are those of serve."))
    from pagedserve.download import add_arguments as add_download
    add_download(commands.add_parser(
        "download", help="fetch a Hub model into the Hugging Face cache ahead of serving; --list what it holds",
        description="Download a model from the Hugging Face Hub into its cache (HF_HOME, HF_HUB_CACHE, or "
                    "--download-dir), only the files serve reads (config, tokenizer, *.safetensors or one "
                    "GGUF), checked as serve checks them, and print its local path. With --list, list the "
                    "models the cache holds with their sizes."))
    from pagedserve.health import add_health_arguments, add_ping_arguments
    add_health_arguments(commands.add_parser(
        "health", help="grpc.health.v1 Check on a frontend; exit 0 if SERVING (a healthcheck)",
        description="Call grpc.health.v1.Health/Check on a frontend and exit 0 if the service is "
                    "SERVING, 1 otherwise (printing the status or the error). --service \"\" is the "
                    "process; pagedserve.v1.Generation means an engine is connected."))
    add_ping_arguments(commands.add_parser(
        "ping-engine", help="ping an engine over ZeroMQ; exit 0 if it answers (a healthcheck)",
        description="Send one Ping to an engine's ZeroMQ endpoint and exit 0 if its Pong arrives "
                    "within --timeout-s, 1 otherwise."))
    bench = commands.add_parser("bench", help="benchmarks", description="Benchmarks.")
    bench_kinds = bench.add_subparsers(dest="bench", required=True, metavar="BENCH")
    from bench.offline import add_arguments as add_offline
    add_offline(bench_kinds.add_parser(
        "offline", help="offline throughput of the engine (optionally against HF transformers)",
        description="Offline throughput: the engine in-process on a fixed workload, "
                    "optionally against HF transformers generate on the same prompts."))
    from bench.serve import add_arguments as add_serve_bench
    add_serve_bench(bench_kinds.add_parser(
        "serve", help="latency and throughput of a gRPC server under load (pagedserve or an HF baseline)",
        description="Serving benchmark: a dataset (random token ids, ShareGPT text, or prompts sharing "
                    "prefixes) streamed through Generate on Poisson (or gamma) arrivals, against --target "
                    "or servers started here one at a time (--backend pagedserve, hf, or both), or through "
                    "the streaming /completions of any OpenAI-compatible server (--backend openai --target "
                    "http://HOST:PORT/v1: pagedserve's HTTP API, vLLM, llama.cpp's llama-server). Every "
                    "request is greedy with eos ignored and max_tokens set to its planned output length, "
                    "so outputs have exactly that many tokens. Reports throughput, goodput, and TTFT, "
                    "TPOT, ITL and E2E latency (mean, median, p90, p99); writes one JSON per run, and "
                    "with --sweep-rates a summary JSON and a throughput-latency PNG."))
    from bench.embeddings import add_arguments as add_embeddings
    add_embeddings(bench_kinds.add_parser(
        "embeddings", help="/v1/embeddings throughput and latency against sentence-transformers encode",
        description="Embeddings benchmark on all-MiniLM-L6-v2 (or --model): 2,000 texts of 8-256 tokens, "
                    "sentence-transformers encode at each batch size (float32 and bfloat16) in this process, "
                    "pagedserve's LLM.embed, then `pagedserve serve` over its HTTP API: texts/s with requests "
                    "of 64 texts from 8 clients, and E2E latency p50/p99 of one text a request from 32. "
                    "Prints each run's ratio to sentence-transformers' best float32 batch size and the cosine "
                    "of every vector to its; writes JSON and a PNG."))
    from bench.spec_decode import add_arguments as add_spec
    add_spec(bench_kinds.add_parser(
        "spec", help="speculative decoding (ngram, draft) against none: TPOT, throughput, acceptance",
        description="Speculative-decoding benchmark: a `pagedserve serve` per --configs entry (off, ngram, "
                    "draft with --draft-model), each running the same requests of two workloads at each "
                    "--concurrency: edit (our own paragraphs to repeat with one phrase changed, as chat, "
                    "greedy, eos honoured: the reply copies the prompt) and random (random token ids, "
                    "greedy, eos ignored). Reports TPOT p50 and mean, TTFT p50, output tok/s, the "
                    "engine's acceptance rate, mean acceptance length and per-position rate (its /metrics "
                    "counters, read around each run), TPOT speed-up over off, and how many replies match "
                    "off's token for token. Writes JSON and a PNG."))
    from bench.scaling import add_arguments as add_scaling
    add_scaling(bench_kinds.add_parser(
        "scaling", help="data parallel: N engines behind one frontend against one, at saturation",
        description="Scaling benchmark: for each --engines count N, N `pagedserve engine` processes "
                    "(--num-threads threads each, default 1) behind one `pagedserve frontend`, loaded with N x "
                    "--concurrency-per-engine requests in flight (random token ids, or prompts sharing "
                    "prefixes with --dataset prefix; greedy, eos ignored). Reports output tok/s, TTFT "
                    "p50/p99, TPOT p50, efficiency = throughput(N) / (N x throughput(1)), the CPU ms per "
                    "output token of the engines, the frontend and the client (from /proc), and each "
                    "engine's share of the tokens and the prefix-cache hit rate (from the engines' "
                    "/metrics). Writes JSON and a PNG."))
    from bench.tensor_parallel import add_arguments as add_tp
    add_tp(bench_kinds.add_parser(
        "tp", help="tensor-parallel sizes against size 1, offline: ms per step, shared memory against gloo",
        description="Tensor-parallel benchmark: for each --sizes entry (and, above 1, each --collectives "
                    "entry: shm or gloo alone), the offline LLM in a fresh process times one generate of "
                    "--num-prompts random prompts (greedy, eos ignored). Reports ms per step, output tok/s, "
                    "the slowdown against the first size and how many replies equal its tokens. Writes JSON."))
    from bench.kernels import add_arguments as add_kernels
    add_kernels(bench_kinds.add_parser(
        "kernels", help="paged-attention kernels against the measured HBM bandwidth (needs a GPU)",
        description="Kernel benchmark: a device-to-device copy's bandwidth, then decode attention's "
                    "achieved bandwidth (K+V read + q + out, over time) at batch 1-256 and context "
                    "128-8192, MHA and GQA 8:1, head 128, bf16, single-pass and split-K; the fixed "
                    "cost per call and the launch cost of data_ptr, __cuda_array_interface__ and "
                    "DLPack. Writes JSON and a PNG. Exits 1 without a CUDA GPU and cupy."))
    from bench.formats import add_arguments as add_formats
    add_formats(bench_kinds.add_parser(
        "formats", help="each weight format's speed beside its perplexity (CPU, in-process)",
        description="Weight formats of one GGUF model's weights, in-process on CPU: float32 and bfloat16 "
                    "(dequantized), int8 and int4 (quantized at load from its float export), the "
                    "GGUF's own blocks, GGUF Q4_0 and Q8_0 (requantized by gguf-py), and checkpoints "
                    "made by the quantizers users run (GPTQModel's GPTQ int4, AWQ, llm-compressor's "
                    "W4A16, W8A16 and FP8, block FP8; minutes to make the first time, then cached). "
                    "For each: perplexity on a fixed text of our own, time per output token of one "
                    "stream, output tok/s of a batch, prefill tok/s of a long prompt and the RSS the "
                    "load adds, with ratios to float32 and the quantized checkpoints' targets against "
                    "their baselines from the same run. Writes JSON and a PNG."))
    from bench.cpu_arithmetic import add_arguments as add_cpu_arithmetic
    add_cpu_arithmetic(bench_kinds.add_parser(
        "cpu-arithmetic", help="each CPU arithmetic's accuracy against HF float32 (perplexity, KL, greedy)",
        description="CPU arithmetics of a GGUF model's quantized layers, in-process: float32, bf16 "
                    "(AVX512-BF16, AMX) and int8 (8-bit activations, integer dot products), each where this "
                    "machine runs it, against HF transformers float32 on the same dequantized weights: "
                    "perplexity on a fixed text of our own, KL divergence of the next-token distribution "
                    "(mean, p99), and greedy agreement on our QA prompts; then issue 49's rule for making "
                    "int8 the default. Writes JSON and a PNG."))
    from bench.kv_cache_dtype import add_arguments as add_kv_cache
    add_kv_cache(bench_kinds.add_parser(
        "kv-cache", help="--kv-cache-dtype int8/fp8 against the unquantized cache (perplexity, capacity, speed)",
        description="KV cache dtypes (auto, int8, fp8) of one GGUF model, in-process on CPU: perplexity on a "
                    "fixed text of our own and its ratio to auto's, greedy agreement with auto, and at a fixed "
                    "--kv-cache-memory-gb the peak of concurrent sequences and the output tok/s of a saturated "
                    "batch, against issue 50's targets. Writes JSON and a PNG."))
    from bench.lora import add_arguments as add_lora
    add_lora(bench_kinds.add_parser(
        "lora", help="multi-LoRA throughput: 1, 4, 16 adapters in the mix against the base model",
        description="Multi-LoRA benchmark (as vLLM's --enable-lora throughput benchmark): random peft "
                    "adapters made in a temporary folder, requests picking one uniformly at random, "
                    "output tok/s with each --num-adapters count against the base model with LoRA off "
                    "and on. Writes JSON and a PNG."))
    from bench.soak import add_arguments as add_soak
    add_soak(bench_kinds.add_parser(
        "soak", help="minutes of mixed load with cancels; checks for KV, RSS and request leaks",
        description="Soak test: start pagedserve serve, keep --concurrency streams in flight for "
                    "--minutes (some cancelled, some with short deadlines), sample RSS of both "
                    "processes and KV usage, then check that every block is free, nothing failed "
                    "unexpectedly and RSS stayed flat after warm-up. Writes JSON and a PNG; exits 1 "
                    "if a check fails."))
    from bench.host_step import add_arguments as add_host_step
    add_host_step(bench_kinds.add_parser(
        "host-step", help="the engine's host time per decode step at 256 sequences (the GPU-idle proxy)",
        description="Host-overhead benchmark: a random-weight model so small that its forward costs "
                    "almost nothing, 256 concurrent greedy decodes; per decode step, the engine step's "
                    "wall time minus the model's, the offline output processing and the GC's pauses. "
                    "--phase prefill times the steps that complete prompts (128 chunks a step) instead. "
                    "--baseline REF measures another commit in the same run."))
    from bench.gpu_busy import add_arguments as add_gpu_busy
    add_gpu_busy(bench_kinds.add_parser(
        "gpu-busy", help="the GPU's busy share of the decode phase at 256 sequences, and the bandwidth bound",
        description="GPU-utilisation benchmark: a random-weight model, 256 concurrent greedy decodes through "
                    "EngineCore.step(); the decode steps' wall time, the device time of their kernels "
                    "(torch.profiler, CUDA activity) and the step's memory-bandwidth bound (weights plus KV "
                    "over the measured copy bandwidth)."))
    return parser


def _check_models(args: argparse.Namespace) -> None:
    """The models and tokenizers a command names, checked by what their files say (ModelError);
    a Hub repo's are downloaded first, here, before anything starts, so that its child processes
    find them in the cache. A frontend reads only its own --tokenizer, and imports nothing of the
    engine (nor torch)."""
    from common.process_args import configure_logging
    configure_logging(getattr(args, "log_level", "info"))  # a download's progress and summary show
    if getattr(args, "hf_token", None):  # huggingface_hub reads it here, and so do the children
        os.environ["HF_TOKEN"] = args.hf_token
    if args.command == "frontend":
        if args.tokenizer is not None:
            from common.tokenizer_files import check_tokenizer_dir, resolve_tokenizer_dir
            folder = resolve_tokenizer_dir(args.tokenizer, args.tokenizer_revision)
            args.tokenizer = str(check_tokenizer_dir(args.tokenizer, folder))
        return
    if args.command == "download" and args.list:
        return
    from engine.models.source import check_models
    check_models(args)


def _take_positional_model(args: argparse.Namespace, rest: list[str]) -> list[str]:
    """`serve MODEL` as `serve --model MODEL` (vLLM's form); the child engine gets --model.
    Returns the command's arguments with that rewrite."""
    tag = getattr(args, "model_tag", None)
    if tag is None:
        return rest
    if args.model is not None and args.model != tag:
        raise ModelError(f"given twice, as MODEL {tag!r} and --model; give one", args.model)
    args.model = tag
    i = rest.index(tag)
    return ["--model", tag, *rest[:i], *rest[i + 1:]]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    if args.command == "download":
        from pagedserve.download import check_args
        check_args(args)
    try:
        rest = _take_positional_model(args, argv[1:])
        _check_models(args)  # before any command opens a port, starts an engine or reads a weight
    except ModelError as e:
        command = " ".join(filter(None, (args.command, getattr(args, "bench", None))))
        print(f"pagedserve {command}: error: {e.as_flag()}", file=sys.stderr)
        return 2
    if args.command == "serve":
        from pagedserve.serve import run
        return run(args, rest)
    if args.command == "run-batch":
        from pagedserve.run_batch import run
        return run(args, argv[1:])
    if args.command == "engine":
        from engine.main import run
        return run(args)
    if args.command == "frontend":
        from frontend.main import run
        return run(args)
    if args.command == "download":
        from pagedserve.download import run
        return run(args)
    if args.command == "health":
        from pagedserve.health import run_health
        return run_health(args)
    if args.command == "ping-engine":
        from pagedserve.health import run_ping
        return run_ping(args)
    if args.command == "bench" and args.bench == "offline":
        from bench.offline import run
        return run(args)
    if args.command == "bench" and args.bench == "serve":
        from bench.serve import run
        return run(args)
    if args.command == "bench" and args.bench == "embeddings":
        from bench.embeddings import run
        return run(args)
    if args.command == "bench" and args.bench == "spec":
        from bench.spec_decode import run
        return run(args)
    if args.command == "bench" and args.bench == "scaling":
        from bench.scaling import run
        return run(args)
    if args.command == "bench" and args.bench == "tp":
        from bench.tensor_parallel import run
        return run(args)
    if args.command == "bench" and args.bench == "kernels":
        from bench.kernels import run
        return run(args)
    if args.command == "bench" and args.bench == "formats":
        from bench.formats import run
        return run(args)
    if args.command == "bench" and args.bench == "cpu-arithmetic":
        from bench.cpu_arithmetic import run
        return run(args)
    if args.command == "bench" and args.bench == "kv-cache":
        from bench.kv_cache_dtype import run
        return run(args)
    if args.command == "bench" and args.bench == "lora":
        from bench.lora import run
        return run(args)
    if args.command == "bench" and args.bench == "host-step":
        from bench.host_step import run
        return run(args)
    if args.command == "bench" and args.bench == "gpu-busy":
        from bench.gpu_busy import run
        return run(args)
    if args.command == "bench" and args.bench == "soak":
        from bench.soak import run
        return run(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
