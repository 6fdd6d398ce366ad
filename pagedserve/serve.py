"""`pagedserve serve`: engine and frontend as two processes, stopped together.

The engine runs as a child process (`pagedserve engine ...` with the same engine flags);
the frontend runs here. Ctrl-C or SIGTERM drains the frontend (running streams finish,
new ones are refused), then stops the engine. If the engine dies, so does `serve`, with
the engine's exit code.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import subprocess
import sys
import threading

from engine.arg_utils import add_drain_arg, add_engine_args, add_log_level_arg, configure_logging
from engine.main import DEFAULT_ADDRESS
from frontend.main import add_arguments as add_frontend_args
from frontend.main import config_from_args
from pagedserve.metrics_http import add_metrics_args

log = logging.getLogger("pagedserve")
ENGINE_STOP_TIMEOUT_S = 15


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--engine-address", default=DEFAULT_ADDRESS,
                   help=f"ZeroMQ endpoint between the two processes (default: {DEFAULT_ADDRESS})")
    add_log_level_arg(p)
    add_drain_arg(p, "on SIGTERM, let running streams finish for at most this long, refusing new "
                     "ones; a second signal stops at once")
    add_metrics_args(p, engine_too=True)
    add_frontend_args(p, with_engine_address=False)
    add_engine_args(p)


# Flags of the frontend alone, with the number of values each takes (-1: all up to the next
# flag); the rest go to the engine.
_FRONTEND_ONLY = {"--host": 1, "--grpc-port": 1, "--max-concurrent-streams": 1, "--engine-timeout-s": 1,
                  "--engine-address": 1, "--log-level": 1, "--metrics-port": 1, "--engine-metrics-port": 1,
                  "--log-prompts": 0, "--http-port": 1, "--served-model-name": -1, "--api-key": 1}


def engine_command(args: argparse.Namespace, argv: list[str]) -> list[str]:
    """The child's command line: our engine flags, passed through unchanged."""
    passthrough, skip = [], 0
    for arg in argv:
        if skip and not (skip < 0 and arg.startswith("--")):
            skip -= 1 if skip > 0 else 0
            continue
        skip = 0
        flag = arg.split("=", 1)[0]
        if flag in _FRONTEND_ONLY:
            skip = 0 if "=" in arg else _FRONTEND_ONLY[flag]
            continue
        passthrough.append(arg)
    metrics = [] if args.engine_metrics_port is None else ["--metrics-port", str(args.engine_metrics_port)]
    return [sys.executable, "-m", "pagedserve", "engine", "--address", args.engine_address,
            "--log-level", args.log_level, *metrics, *passthrough]


def run(args: argparse.Namespace, argv: list[str]) -> int:
    configure_logging(args.log_level)
    import uvloop
    engine = subprocess.Popen(engine_command(args, argv))
    engine_died = threading.Event()
    try:
        uvloop.run(_frontend(config_from_args(args, args.engine_address), engine, engine_died))
        return (engine.returncode or 1) if engine_died.is_set() else 0
    finally:
        engine.terminate()
        try:
            engine.wait(ENGINE_STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            log.warning("engine did not stop in %ss; killing it", ENGINE_STOP_TIMEOUT_S)
            engine.kill()
            engine.wait()


async def _frontend(config, engine: subprocess.Popen, engine_died: threading.Event) -> None:
    """The frontend, stopped as a signal would stop it if the engine exits on its own (a bad
    --model at start-up, a crash): `serve` must not outlive its engine."""
    from frontend.server import serve as serve_frontend
    stop, loop = asyncio.Event(), asyncio.get_running_loop()

    def watch() -> None:
        code = engine.wait()
        if stop.is_set():
            return  # we are stopping it
        log.error("engine exited with code %s; stopping", code)
        engine_died.set()
        try:
            loop.call_soon_threadsafe(stop.set)
        except RuntimeError:
            pass  # the loop is closed: the frontend has stopped already

    threading.Thread(target=watch, name="engine-watch", daemon=True).start()
    await serve_frontend(config, stop)
