"""`pagedserve serve`: engine and frontend as two processes, stopped together.

The engine runs as a child process (`pagedserve engine ...` with the same engine flags);
the frontend runs here. Ctrl-C or SIGTERM stops the frontend, then the engine.
"""

from __future__ import annotations

import argparse
import logging
import subprocess
import sys

from engine.arg_utils import add_engine_args, add_log_level_arg, configure_logging
from engine.main import DEFAULT_ADDRESS
from frontend.main import add_arguments as add_frontend_args
from frontend.main import config_from_args

log = logging.getLogger("pagedserve")
ENGINE_STOP_TIMEOUT_S = 15


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--engine-address", default=DEFAULT_ADDRESS,
                   help=f"ZeroMQ endpoint between the two processes (default: {DEFAULT_ADDRESS})")
    add_log_level_arg(p)
    add_frontend_args(p, with_engine_address=False)
    add_engine_args(p)


def engine_command(args: argparse.Namespace, argv: list[str]) -> list[str]:
    """The child's command line: our engine flags, passed through unchanged."""
    frontend_only = {"--host", "--grpc-port", "--max-concurrent-streams", "--engine-timeout-s",
                     "--engine-address", "--log-level"}
    passthrough, skip = [], False
    for i, arg in enumerate(argv):
        if skip:
            skip = False
            continue
        flag = arg.split("=", 1)[0]
        if flag in frontend_only:
            skip = "=" not in arg
            continue
        passthrough.append(arg)
    return [sys.executable, "-m", "pagedserve", "engine", "--address", args.engine_address,
            "--log-level", args.log_level, *passthrough]


def run(args: argparse.Namespace, argv: list[str]) -> int:
    configure_logging(args.log_level)
    from frontend.server import run as run_frontend
    engine = subprocess.Popen(engine_command(args, argv))
    try:
        return run_frontend(config_from_args(args, args.engine_address))
    finally:
        engine.terminate()
        try:
            engine.wait(ENGINE_STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            log.warning("engine did not stop in %ss; killing it", ENGINE_STOP_TIMEOUT_S)
            engine.kill()
            engine.wait()
