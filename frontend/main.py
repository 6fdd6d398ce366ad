"""`pagedserve frontend`: the gRPC frontend process on its own, over one engine or several
(`--engine-address` repeated, or `--engine-dns`: data parallel)."""

from __future__ import annotations

import argparse
import os

from common.metrics_http import add_metrics_args
from common.process_args import (DEFAULT_ADDRESS, add_drain_arg, add_log_level_arg, configure_logging,
                                  non_negative_int, positive_float)
from frontend.multimodal import DEFAULT_MAX_IMAGES, image_limit
from frontend.router import POLICIES


def add_arguments(p: argparse.ArgumentParser, with_engine_address: bool = True) -> None:
    if with_engine_address:
        p.add_argument("--engine-address", action="append", default=None, metavar="ADDRESS",
                       help="an engine's ZeroMQ endpoint; repeat it for several engines (data parallel) "
                            f"(default: {DEFAULT_ADDRESS} unless --engine-dns is given)")
        p.add_argument("--engine-dns", type=_dns_name, default=None, metavar="HOST:PORT",
                       help="find engines by DNS: every A/AAAA record of HOST is an engine at tcp://IP:PORT "
                            "(a Kubernetes headless Service, docker compose --scale); re-resolved every "
                            "--engine-dns-interval-s, and engines whose record goes are drained, then dropped")
        p.add_argument("--engine-dns-interval-s", type=positive_float, default=5.0,
                       help="how often --engine-dns is resolved again, in seconds (default: 5)")
    p.add_argument("--routing-policy", choices=POLICIES, default="cache_aware",
                   help="how a request picks its engine when there are several: cache_aware (the engine "
                        "holding the longest cached prefix of its prompt, unless load is unbalanced), "
                        "least_loaded (fewest waiting + running requests for its KV capacity), or "
                        "round_robin (default: cache_aware)")
    p.add_argument("--host", default="127.0.0.1", help="listen host of the gRPC and HTTP APIs (default: 127.0.0.1)")
    p.add_argument("--grpc-port", type=int, default=50051,
                   help="gRPC port; 0 picks a free one (default: 50051)")
    p.add_argument("--http-port", type=_port_or_off, default=8000,
                   help="OpenAI/Anthropic-compatible HTTP API port; 0 picks a free one, 'off' disables it "
                        "(default: 8000)")
    p.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="model name(s) the HTTP API answers to (default: the model's own name)")
    p.add_argument("--api-key", default=os.environ.get("PAGEDSERVE_API_KEY") or None,
                   help="require this key on the HTTP API's /v1 routes (Authorization: Bearer KEY); "
                        "default: $PAGEDSERVE_API_KEY, else none")
    p.add_argument("--allow-runtime-lora", action="store_true",
                   help="allow POST /v1/load_lora_adapter and /v1/unload_lora_adapter without --api-key "
                        "(only on a trusted network: they make the engines read adapter folders by path); "
                        "with --api-key they need the key and this flag is not needed (default: off)")
    p.add_argument("--max-concurrent-streams", type=int, default=256,
                   help="generations in flight at once, gRPC and HTTP together; more get "
                        "RESOURCE_EXHAUSTED / 429 (default: 256)")
    p.add_argument("--engine-timeout-s", type=float, default=3.0,
                   help="engine silence after which it counts as lost (default: 3.0)")
    add_http_arguments(p)
    p.add_argument("--log-prompts", action="store_true",
                   help="put each request's prompt in its log line (default: off; prompts may be private)")
    if with_engine_address:
        add_drain_arg(p, "on SIGTERM, let running streams finish for at most this long, refusing new "
                         "ones; a second signal stops at once")
        add_metrics_args(p)
        p.add_argument("--tokenizer", default=None,
                       help="tokenizer: a folder with tokenizer.json, or a Hub repo id that has one (default: "
                            "the engine's model's, learnt in the handshake)")
        p.add_argument("--tokenizer-revision", default=None,
                       help="the --tokenizer's Hub revision: a branch, tag or commit (default: main)")
        add_log_level_arg(p)


def add_http_arguments(p: argparse.ArgumentParser) -> None:
    from frontend.harmony import NAME as HARMONY
    from frontend.reasoning.parsers import NAMES as REASONING_PARSERS
    from frontend.tool_calls.parsers import NAMES as TOOL_PARSERS
    p.add_argument("--tool-call-parser", default="auto", choices=("auto", *TOOL_PARSERS, HARMONY),
                   help="how tool calls are found in the output when tool_choice is auto (each model family "
                        "writes them its own way); auto: harmony for gpt-oss, else chosen from the model's "
                        "chat template (default: auto)")
    p.add_argument("--reasoning-parser", default="auto", choices=("auto", "none", *REASONING_PARSERS, HARMONY),
                   help="how reasoning is split from the answer (reasoning_content, Anthropic thinking blocks, "
                        "Responses reasoning items); none keeps it in the content; auto: harmony for gpt-oss, "
                        "else chosen from the model's chat template where that is unambiguous, else none "
                        "(default: auto). harmony (either parser) also renders chat prompts in harmony")
    p.add_argument("--response-store-size", type=non_negative_int, default=1000, metavar="N",
                   help="responses of /v1/responses (store=true) kept in this frontend's memory for "
                        "previous_response_id and GET, least recently used dropped first (default: 1000)")
    p.add_argument("--response-ttl-s", type=positive_float, default=3600.0,
                   help="how long a stored response is kept, in seconds (default: 3600)")
    p.add_argument("--data-dir", default=None, metavar="DIR",
                   help="where /v1/files and /v1/batches keep their files (default: a folder under "
                        "~/.cache/pagedserve)")
    p.add_argument("--allowed-media-domains", nargs="+", default=[], metavar="HOST",
                   help="hosts whose http(s) image URLs the HTTP API fetches (image_url parts, Anthropic url "
                        "sources, Responses input_image), each matched exactly (example.com does not allow "
                        "cdn.example.com); redirects are followed on the same host only (default: none: "
                        "images come as data URLs or base64, and every URL is refused)")
    p.add_argument("--limit-mm-per-prompt", type=image_limit, default=DEFAULT_MAX_IMAGES, metavar="image=N",
                   help="the most images one prompt may have, as vLLM's flag takes it (image=N, or JSON "
                        "'{\"image\": N}'); more get a 400 / INVALID_ARGUMENT, checked before any is fetched "
                        f"or decoded (default: image={DEFAULT_MAX_IMAGES})")
    p.add_argument("--media-fetch-timeout-s", type=positive_float, default=10.0,
                   help="how long fetching one image URL may take, redirects and body included, in seconds "
                        "(default: 10)")


def http_options_from_args(args: argparse.Namespace):
    from frontend.http.options import HttpOptions
    return HttpOptions(tool_call_parser=args.tool_call_parser, reasoning_parser=args.reasoning_parser,
                       response_store_size=args.response_store_size, response_ttl_s=args.response_ttl_s,
                       data_dir=args.data_dir, allowed_media_domains=tuple(args.allowed_media_domains),
                       media_fetch_timeout_s=args.media_fetch_timeout_s, max_images=args.limit_mm_per_prompt)


def config_from_args(args: argparse.Namespace, engine_addresses: list[str], engine_dns: str | None = None,
                     engine_dns_interval_s: float = 5.0):
    from frontend.server import FrontendConfig
    return FrontendConfig(engine_addresses=engine_addresses, engine_dns=engine_dns,
                          engine_dns_interval_s=engine_dns_interval_s, routing_policy=args.routing_policy,
                          host=args.host, grpc_port=args.grpc_port,
                          tokenizer=args.tokenizer, max_concurrent_streams=args.max_concurrent_streams,
                          engine_timeout_s=args.engine_timeout_s, drain_timeout_s=args.drain_timeout_s,
                          metrics_port=args.metrics_port, metrics_host=args.metrics_host,
                          log_prompts=args.log_prompts, http_port=args.http_port,
                          served_model_names=args.served_model_name or [], api_key=args.api_key,
                          allow_runtime_lora=args.allow_runtime_lora, http_options=http_options_from_args(args))


def run(args: argparse.Namespace) -> int:
    configure_logging(args.log_level)
    from frontend.server import run as run_server
    addresses = args.engine_address or ([] if args.engine_dns else [DEFAULT_ADDRESS])
    return run_server(config_from_args(args, addresses, args.engine_dns, args.engine_dns_interval_s))


def _dns_name(text: str) -> str:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not HOST:PORT")
    return text


def _port_or_off(value: str) -> int | None:
    if value == "off":
        return None
    port = int(value)
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{value} is not a port (0-65535) or 'off'")
    return port
