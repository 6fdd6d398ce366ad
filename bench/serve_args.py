"""The flags of `pagedserve bench serve`, and their checks (one place for both)."""

from __future__ import annotations

import argparse
import math
import re
from dataclasses import dataclass
from pathlib import Path

from bench.datasets import SHAREGPT_SAMPLE, length_range
from bench.random_model import add_random_weights_arg
from bench.serve_metrics import parse_goodput
from bench.servers import BACKENDS
from engine.arg_utils import add_engine_args

DATASETS = ("random", "sharegpt", "prefix-repetition", "structured", "embeddings")
API_BACKENDS = ("openai",)  # an API, not a server: it needs a --target


@dataclass
class ServePlan:
    """What the flags ask for, checked: every run is one (backend, rate)."""

    backends: list[str]
    rates: list[float]  # one per run; inf sends every request at once
    dataset: str
    dataset_path: Path | None  # sharegpt only
    slos: dict[str, float]  # goodput SLOs in ms, by metric name
    structured_ratios: list[float | None]  # structured: constrained share per run, in turn; else [None]

    def runs(self) -> list[tuple[float, float | None]]:
        """(rate, structured ratio) of each run, in order (one of the two lists has one item)."""
        return [(rate, ratio) for rate in self.rates for ratio in self.structured_ratios]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backend", default="pagedserve", metavar="NAME[,NAME]",
                   help="what to benchmark: pagedserve (`pagedserve serve`), hf (HF transformers generate, one "
                        "request at a time, behind the same gRPC API: bench.hf_server), or a comma list to run "
                        "the same workload on each in turn; hf takes --model, --tokenizer, --dtype, --device, "
                        "--num-threads and --max-model-len from the engine flags; openai: the OpenAI API of "
                        "the server at --target (streaming /completions), with --model (or --random-weights) and "
                        "--tokenizer naming the served model's local files, for its vocabulary and token counts "
                        "(default: "
                        "pagedserve)")
    p.add_argument("--target", default=None, metavar="HOST:PORT|URL",
                   help="a running server to benchmark: HOST:PORT of a gRPC one, or with --backend openai the "
                        "base URL of an OpenAI-compatible one, http://HOST:PORT/v1 (default: start each backend "
                        "here with the engine flags below, one at a time, and stop it after; with a gRPC "
                        "--target they are ignored and --backend only labels the results)")
    p.add_argument("--served-model-name", default=None, metavar="NAME",
                   help="openai: the requests' `model` (default: the first id of GET TARGET/models)")
    p.add_argument("--api-key", default=None, help="openai: sent as `Authorization: Bearer KEY` (never saved)")
    p.add_argument("--label", default=None,
                   help="names the run in file names and tables instead of the backend, e.g. llama-server "
                        "(one backend only)")
    p.add_argument("--dataset-name", choices=DATASETS, default=None,
                   help="random token ids, ShareGPT conversations (text), prefix-repetition (many prompts "
                        "sharing long prefixes: shows prefix caching), or structured (chat prompts asking for "
                        "JSON, each paired with a JSON Schema: see --structured-ratio), or embeddings (texts "
                        "of our own prose to POST /v1/embeddings, --embed-batch-size a request, on an embedding "
                        "model: --model defaults to all-MiniLM-L6-v2; the server started here, or --backend "
                        "openai --target URL) (default: random, or sharegpt with --dataset-path)")
    p.add_argument("--dataset-path", type=Path, default=None,
                   help="ShareGPT-format JSON: a list of {\"conversations\": [{\"from\": \"human\", \"value\": "
                        "...}, {\"from\": \"gpt\", \"value\": ...}]}; the first turn is the prompt, its reply "
                        f"sets the output length (default: the bundled sample, {SHAREGPT_SAMPLE.name}; see "
                        "bench/data/README.md)")
    p.add_argument("--num-prompts", type=int, default=64, help="requests per run (default: 64)")
    p.add_argument("--random-input-len", type=int, default=128, help="random: prompt tokens (default: 128)")
    p.add_argument("--random-output-len", type=int, default=128, help="random: output tokens (default: 128)")
    p.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="random: lengths uniform in [len*(1-r), len*(1+r)], 0 <= r < 1 (default: 0)")
    p.add_argument("--prefix-len", type=int, default=256,
                   help="prefix-repetition: tokens of each shared prefix (default: 256)")
    p.add_argument("--suffix-len", type=int, default=32,
                   help="prefix-repetition: tokens after the prefix, unique per prompt (default: 32)")
    p.add_argument("--num-prefixes", type=int, default=4, help="prefix-repetition: distinct prefixes (default: 4)")
    p.add_argument("--prefix-output-len", type=int, default=64,
                   help="prefix-repetition: output tokens (default: 64)")
    p.add_argument("--sharegpt-output-len", type=int, default=None,
                   help="sharegpt: cap on the output length (default: the reply's length)")
    p.add_argument("--structured-ratio", type=_ratio_list, default=[0.5], metavar="R[,R,...]",
                   help="structured: the share of requests sent with their schema as a json_schema constraint "
                        "(the rest are the same kind of prompt, unconstrained); a comma list runs the same "
                        "prompts once per share, e.g. 0,0.5,1 for an unconstrained baseline, a mix and all "
                        "constrained; the report splits throughput, TPOT, output lengths and valid outputs "
                        "by group, and gives the engine's grammar-mask, sample and model time per step "
                        "(default: 0.5)")
    p.add_argument("--structured-output-len", type=int, default=256,
                   help="structured: max_tokens of every request; replies end on their own (eos, or the "
                        "constrained JSON completing), so this is a cap, and a reply cut by it counts as "
                        "invalid (default: 256)")
    p.add_argument("--embed-batch-size", type=int, default=1,
                   help="embeddings: texts per /v1/embeddings request (default: 1)")
    p.add_argument("--embed-min-len", type=int, default=8,
                   help="embeddings: shortest text in tokens, special tokens included (default: 8)")
    p.add_argument("--embed-max-len", type=int, default=256,
                   help="embeddings: longest text in tokens; lengths are uniform in between (default: 256, "
                        "all-MiniLM-L6-v2's limit)")
    p.add_argument("--metrics-url", default=None, metavar="URL",
                   help="structured with a gRPC --target: the target engine's Prometheus /metrics, e.g. "
                        "http://HOST:PORT/metrics of `pagedserve serve --engine-metrics-port PORT`, for the "
                        "per-step phase times (default: a server started here has its engine's /metrics "
                        "turned on and read; a --target without this reports none)")
    p.add_argument("--request-rate", type=_rate, default=None,
                   help="requests per second, a Poisson process (see --burstiness); inf sends all at once "
                        "(default: inf)")
    p.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma-distributed gaps between arrivals with this shape and the same mean: 1 is "
                        "Poisson, < 1 burstier, > 1 more even (default: 1)")
    p.add_argument("--max-concurrency", type=int, default=None,
                   help="most requests in flight at once; later arrivals wait for a slot (default: no limit)")
    p.add_argument("--sweep-rates", type=_rate_list, default=None, metavar="RATE,RATE,...",
                   help="one run per request rate (e.g. 0.5,1,2,inf), then a summary JSON and a PNG of TTFT "
                        "and TPOT p50/p99 against output throughput, one curve per backend")
    p.add_argument("--goodput", nargs="+", default=None, metavar="METRIC:MS",
                   help="SLOs for goodput, e.g. ttft:500 tpot:100 (also e2e:MS): completed requests per "
                        "second that met every one")
    p.add_argument("--seed", type=int, default=0, help="seed for prompts, lengths and arrivals (default: 0)")
    p.add_argument("--compare-offline", action="store_true",
                   help="also time engine.LLM in this process on the same prompts, before the server starts, "
                        "and report grpc / offline output throughput (random dataset, one rate, backend "
                        "pagedserve, no --target)")
    p.add_argument("--output-dir", type=Path, default=None,
                   help="where to write JSON and PNG (default: bench/results)")
    add_random_weights_arg(p)
    add_engine_args(p, dtype="auto")


def check_args(args: argparse.Namespace) -> ServePlan:
    """Raises SystemExit with a message that says what to change."""
    backends = [b.strip() for b in args.backend.split(",") if b.strip()]
    bad = [b for b in backends if b not in BACKENDS + API_BACKENDS]
    if not backends or bad or len(set(backends)) != len(backends):
        _fail(f"--backend: a comma list of distinct names from {', '.join(BACKENDS)}, or openai with "
              f"--target, got {args.backend!r}")
    if args.target and len(backends) > 1:
        _fail("--target benchmarks whatever runs there: give one --backend (it only labels the "
              "results), or drop --target to start each backend here")
    _check_target(args, backends)
    if args.label is not None and (len(backends) > 1 or not re.fullmatch(r"[A-Za-z0-9_.-]+", args.label)):
        _fail(f"--label: one backend, and letters, digits, '.', '-', '_' only (it goes in file names), "
              f"got {args.label!r}")
    if args.request_rate is not None and args.sweep_rates is not None:
        _fail("give --request-rate or --sweep-rates, not both")
    rates = args.sweep_rates or [args.request_rate if args.request_rate is not None else math.inf]
    dataset = args.dataset_name or ("sharegpt" if args.dataset_path else "random")
    if args.dataset_path and dataset != "sharegpt":
        _fail(f"--dataset-path is for sharegpt, not --dataset-name {dataset}")
    path = (args.dataset_path or SHAREGPT_SAMPLE) if dataset == "sharegpt" else None
    if path is not None and not path.is_file():
        _fail(f"--dataset-path {path}: no such file")
    _check_numbers(args)
    ratios = _check_structured(args, backends, rates, dataset)
    if args.compare_offline:
        _check_offline(args, backends, rates, dataset)
    try:
        slos = parse_goodput(args.goodput)
    except ValueError as e:
        _fail(str(e))
    _check_embeddings(args, backends, rates, dataset, slos)
    return ServePlan(backends, rates, dataset, path, slos, ratios)


def _check_target(args: argparse.Namespace, backends: list[str]) -> None:
    url = bool(args.target) and args.target.startswith(("http://", "https://"))
    if "openai" in backends:
        if not url or len(backends) > 1:
            _fail("--backend openai drives a running server: give it alone, with --target http://HOST:PORT/v1 "
                  "(this benchmark does not start one)")
        args.target = args.target.rstrip("/")
    elif url:
        _fail(f"--target {args.target} is a URL: add --backend openai (the other backends speak gRPC, HOST:PORT)")
    elif args.served_model_name or args.api_key:
        _fail("--served-model-name and --api-key are for --backend openai")


def _check_numbers(args: argparse.Namespace) -> None:
    positive = {"--num-prompts": args.num_prompts, "--random-input-len": args.random_input_len,
                "--random-output-len": args.random_output_len, "--num-prefixes": args.num_prefixes,
                "--prefix-output-len": args.prefix_output_len, "--max-concurrency": args.max_concurrency,
                "--sharegpt-output-len": args.sharegpt_output_len,
                "--structured-output-len": args.structured_output_len, "--embed-batch-size": args.embed_batch_size,
                "--embed-min-len": args.embed_min_len}
    for flag, value in positive.items():
        if value is not None and value < 1:
            _fail(f"{flag}: must be at least 1, got {value}")
    if args.prefix_len < 0 or args.suffix_len < 0 or args.prefix_len + args.suffix_len < 1:
        _fail("--prefix-len and --suffix-len: must be >= 0, and the prompt at least one token")
    if not args.burstiness > 0:
        _fail(f"--burstiness: must be > 0, got {args.burstiness}")
    try:
        length_range(1, args.random_range_ratio)
    except ValueError as e:
        _fail(f"--random-range-ratio: {e}")


def _check_structured(args: argparse.Namespace, backends: list[str], rates: list[float], dataset: str
                      ) -> list[float | None]:
    if dataset != "structured":
        if args.metrics_url:
            _fail("--metrics-url is for --dataset-name structured")
        return [None]
    if backends != ["pagedserve"]:
        _fail("--dataset-name structured sends json_schema constraints over gRPC: --backend pagedserve only")
    if len(args.structured_ratio) > 1 and len(rates) > 1:
        _fail("give several --structured-ratio values or several --sweep-rates, not both")
    if args.metrics_url and not args.target:
        _fail("--metrics-url is for a --target: a server started here has its metrics read anyway")
    return args.structured_ratio


def _check_embeddings(args: argparse.Namespace, backends: list[str], rates: list[float], dataset: str,
                      slos: dict[str, float]) -> None:
    if dataset != "embeddings":
        return
    if backends not in (["pagedserve"], ["openai"]) or (backends == ["pagedserve"] and args.target):
        _fail("--dataset-name embeddings posts to /v1/embeddings: --backend pagedserve (started here) or "
              "--backend openai --target http://HOST:PORT/v1")
    if len(rates) > 1:
        _fail("--dataset-name embeddings runs one --request-rate at a time, not --sweep-rates")
    if set(slos) - {"e2e"}:
        _fail("--dataset-name embeddings: its requests have only an E2E latency (--goodput e2e:MS)")
    if args.embed_max_len < args.embed_min_len:
        _fail(f"--embed-max-len: must be at least --embed-min-len ({args.embed_min_len}), got {args.embed_max_len}")
    if args.model is None and args.random_weights is None:
        from bench.serve_embeddings import DEFAULT_MODEL
        args.model = DEFAULT_MODEL


def _check_offline(args: argparse.Namespace, backends: list[str], rates: list[float], dataset: str) -> None:
    if args.target:
        _fail("--compare-offline needs the server on this machine: drop --target")
    if dataset != "random" or backends != ["pagedserve"] or len(rates) != 1:
        _fail("--compare-offline works on the random dataset with one rate and --backend pagedserve")


def _rate(text: str) -> float:
    try:
        rate = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a request rate is a number or inf, got {text!r}") from None
    if not rate > 0:
        raise argparse.ArgumentTypeError(f"a request rate must be > 0, got {text!r}")
    return rate


def _rate_list(text: str) -> list[float]:
    rates = [_rate(t.strip()) for t in text.split(",") if t.strip()]
    if not rates:
        raise argparse.ArgumentTypeError("give at least one rate, e.g. 0.5,1,2")
    return rates


def _ratio_list(text: str) -> list[float]:
    try:
        ratios = [float(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"a comma list of shares from 0 to 1, got {text!r}") from None
    if not ratios or not all(0 <= r <= 1 for r in ratios):
        raise argparse.ArgumentTypeError(f"a comma list of shares from 0 to 1, e.g. 0,0.5,1, got {text!r}")
    return ratios


def _fail(message: str) -> None:
    raise SystemExit(f"bench serve: {message}")
