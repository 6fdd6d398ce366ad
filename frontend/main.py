"""`pagedserve frontend`: the gRPC frontend process on its own."""

from __future__ import annotations

import argparse
import os

from engine.arg_utils import add_drain_arg, add_log_level_arg, configure_logging
from engine.main import DEFAULT_ADDRESS
from pagedserve.metrics_http import add_metrics_args


def add_arguments(p: argparse.ArgumentParser, with_engine_address: bool = True) -> None:
    if with_engine_address:
        p.add_argument("--engine-address", default=DEFAULT_ADDRESS,
                       help=f"the engine's ZeroMQ endpoint (default: {DEFAULT_ADDRESS})")
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
    p.add_argument("--max-concurrent-streams", type=int, default=256,
                   help="generations in flight at once, gRPC and HTTP together; more get "
                        "RESOURCE_EXHAUSTED / 429 (default: 256)")
    p.add_argument("--engine-timeout-s", type=float, default=3.0,
                   help="engine silence after which it counts as lost (default: 3.0)")
    p.add_argument("--log-prompts", action="store_true",
                   help="put each request's prompt in its log line (default: off; prompts may be private)")
    if with_engine_address:
        add_drain_arg(p, "on SIGTERM, let running streams finish for at most this long, refusing new "
                         "ones; a second signal stops at once")
        add_metrics_args(p)
        p.add_argument("--tokenizer", default=None,
                       help="tokenizer folder (default: the engine's model, learnt in the handshake)")
        add_log_level_arg(p)


def config_from_args(args: argparse.Namespace, engine_address: str):
    from frontend.server import FrontendConfig
    return FrontendConfig(engine_address=engine_address, host=args.host, grpc_port=args.grpc_port,
                          tokenizer=args.tokenizer, max_concurrent_streams=args.max_concurrent_streams,
                          engine_timeout_s=args.engine_timeout_s, drain_timeout_s=args.drain_timeout_s,
                          metrics_port=args.metrics_port, metrics_host=args.metrics_host,
                          log_prompts=args.log_prompts, http_port=args.http_port,
                          served_model_names=args.served_model_name or [], api_key=args.api_key)


def run(args: argparse.Namespace) -> int:
    configure_logging(args.log_level)
    from frontend.server import run as run_server
    return run_server(config_from_args(args, args.engine_address))


def _port_or_off(value: str) -> int | None:
    if value == "off":
        return None
    port = int(value)
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{value} is not a port (0-65535) or 'off'")
    return port
