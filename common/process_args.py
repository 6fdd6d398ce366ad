"""Command-line pieces every pagedserve process shares: the engine's default endpoint, the
log level, the drain timeout."""

from __future__ import annotations

import argparse

DEFAULT_ADDRESS = "tcp://127.0.0.1:5570"  # the engine's ZeroMQ endpoint, and a frontend's default


def add_log_level_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                        help="log level (default: info)")


def add_drain_arg(parser: argparse.ArgumentParser, what: str) -> None:
    parser.add_argument("--drain-timeout-s", type=float, default=30.0,
                        help=f"{what} (default: 30)")


def configure_logging(level: str) -> None:
    import logging
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
