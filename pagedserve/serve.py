"""`pagedserve serve`: engine and frontend as two processes, stopped together.

The engine runs as a child process (`pagedserve engine ...` with the same engine flags);
the frontend runs here. Ctrl-C or SIGTERM drains the frontend (running streams finish,
new ones are refused), then stops the engine. If the engine dies, so does `serve`, with
the engine's exit code.

`--data-parallel-size N` starts N engine children on N endpoints (tcp ports PORT, PORT+1, ...;
ipc paths PATH-0, PATH-1, ...; engine metrics ports likewise) behind the one frontend.

`--api-server-count N` runs N frontend processes on the same gRPC and HTTP ports (this one and
N-1 spawned children, each connected to every engine): the kernel spreads new connections
over them (SO_REUSEPORT), so N cores parse, detokenize and stream. A signal to `serve` is
passed on to the children, which drain as this one does; if one dies, `serve` stops.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import subprocess
import sys
import threading
from urllib.parse import urlsplit

from common.metrics_http import add_metrics_args
from common.process_args import (DEFAULT_ADDRESS, ENGINE_STOP_TIMEOUT_S, add_drain_arg, add_log_level_arg,
                                  configure_logging, default_num_threads, positive_int, stop_engines)
from engine.arg_utils import add_engine_args
from frontend.main import add_arguments as add_frontend_args, config_from_args

log = logging.getLogger("pagedserve")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model_tag", nargs="?", metavar="MODEL",
                   help="the model, as --model takes it: a Hub repo id (ORG/NAME[:TAG]), a folder or a .gguf file")
    p.add_argument("--engine-address", default=DEFAULT_ADDRESS,
                   help="ZeroMQ endpoint between the two processes; with --data-parallel-size N, the "
                        f"first of N (tcp: the next N-1 ports; ipc: PATH-0 ... PATH-N-1) (default: {DEFAULT_ADDRESS})")
    p.add_argument("--data-parallel-size", type=positive_int, default=1, metavar="N",
                   help="engine processes behind the one frontend, each with the same engine flags (without "
                        "--num-threads, each gets its share of the cores); with --engine-metrics-port PORT they "
                        "serve /metrics on PORT, PORT+1, ... (default: 1)")
    p.add_argument("--api-server-count", type=positive_int, default=1, metavar="N",
                   help="frontend processes sharing the gRPC and HTTP ports: the kernel spreads new connections "
                        "over them (SO_REUSEPORT), so N cores parse, detokenize and stream (a gRPC channel is one "
                        "connection: spread load with several channels); needs fixed ports; with --metrics-port "
                        "PORT, frontend i serves /metrics on PORT+i (default: 1)")
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
                  "--log-prompts": 0, "--http-port": 1, "--served-model-name": -1, "--api-key": 1,
                  "--data-parallel-size": 1, "--routing-policy": 1, "--allow-runtime-lora": 0,
                  "--api-server-count": 1, "--tool-call-parser": 1, "--reasoning-parser": 1,
                  "--response-store-size": 1, "--response-ttl-s": 1, "--data-dir": 1,
                  "--allowed-media-domains": -1, "--media-fetch-timeout-s": 1, "--limit-mm-per-prompt": 1,
                  "--hf-token": 1}  # the token reaches the engine in its environment, not its command line


def engine_addresses(address: str, n: int) -> list[str]:
    """N distinct endpoints from the first."""
    if n == 1:
        return [address]
    if address.startswith("tcp://"):
        base = urlsplit(address)
        host = address[len("tcp://"):].rsplit(":", 1)[0]
        return [f"tcp://{host}:{base.port + i}" for i in range(n)]
    return [f"{address}-{i}" for i in range(n)]


def engine_command(args: argparse.Namespace, argv: list[str], address: str | None = None,
                   metrics_port: int | None = None) -> list[str]:
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
    metrics_port = args.engine_metrics_port if metrics_port is None else metrics_port
    metrics = [] if metrics_port is None else ["--metrics-port", str(metrics_port)]
    if args.num_threads is None and args.data_parallel_size > 1:
        # Each engine would take every core (torch's default): N engines would fight over them.
        passthrough += ["--num-threads", str(max(1, default_num_threads() // args.data_parallel_size))]
    return [sys.executable, "-m", "pagedserve", "engine", "--address", address or args.engine_address,
            "--log-level", args.log_level, *metrics, *passthrough]


def run(args: argparse.Namespace, argv: list[str]) -> int:
    configure_logging(args.log_level)
    if args.api_server_count > 1 and (args.grpc_port == 0 or args.http_port == 0):
        print("error: --api-server-count N > 1 needs fixed --grpc-port and --http-port (not 0): the N "
              "frontends share them", file=sys.stderr)
        return 2
    import uvloop
    addresses = engine_addresses(args.engine_address, args.data_parallel_size)
    port = args.engine_metrics_port
    engines = [subprocess.Popen(engine_command(args, argv, address, None if port is None or port == 0 else port + i))
               for i, address in enumerate(addresses)]
    config = config_from_args(args, addresses)
    config.reuse_port = args.api_server_count > 1
    died: list[int] = []  # exit codes of children that ended on their own
    try:
        uvloop.run(_frontend(config, engines, died, args.api_server_count, args.log_level))
        return (died[0] or 1) if died else 0
    finally:
        stop_engines(engines)


async def _frontend(config, engines: list[subprocess.Popen], died: list[int], api_server_count: int,
                    log_level: str) -> None:
    """The frontend here, and api_server_count - 1 more in spawned children, stopped as a signal
    would stop them if an engine or a child frontend exits on its own (a bad --model at
    start-up, a crash): `serve` must not outlive its parts."""
    from frontend.server import serve as serve_frontend
    stop, loop = asyncio.Event(), asyncio.get_running_loop()

    def watch(name: str, pid: int, wait) -> None:
        code = wait()
        if stop.is_set():
            return  # we are stopping it
        log.error("%s exited with code %s (pid %d); stopping", name, code, pid)
        died.append(code)
        try:
            loop.call_soon_threadsafe(stop.set)
        except RuntimeError:
            pass  # the loop is closed: the frontend has stopped already

    for engine in engines:
        threading.Thread(target=watch, args=("engine", engine.pid, engine.wait),
                         name=f"engine-watch-{engine.pid}", daemon=True).start()
    children = [_start_frontend(config, i, log_level) for i in range(1, api_server_count)]
    for child in children:
        threading.Thread(target=watch, args=(f"frontend {child.name}", child.pid, _joiner(child)),
                         name=f"frontend-watch-{child.pid}", daemon=True).start()
    forward = asyncio.ensure_future(_pass_on_stop(stop, children))
    try:
        await serve_frontend(config, stop)
    finally:
        stop.set()  # (already set, unless the frontend failed): the children drain too
        await forward
        await loop.run_in_executor(None, _join_frontends, children, config.drain_timeout_s + ENGINE_STOP_TIMEOUT_S)


def _start_frontend(config, index: int, log_level: str):
    """Frontend `index` (1, 2, ...) in a spawned process: the same config on the same ports;
    its /metrics, if any, on metrics_port + index."""
    import dataclasses
    import multiprocessing

    metrics_port = None if config.metrics_port is None else config.metrics_port + index
    child = multiprocessing.get_context("spawn").Process(
        target=_run_frontend, args=(dataclasses.replace(config, metrics_port=metrics_port), log_level),
        name=f"frontend-{index}", daemon=False)
    child.start()
    return child


def _run_frontend(config, log_level: str) -> int:
    """A spawned frontend's process: a fresh interpreter, so its logging is set up again."""
    from frontend.server import run as run_frontend
    configure_logging(log_level)
    return run_frontend(config)


def _joiner(child):
    def wait() -> int | None:
        child.join()
        return child.exitcode
    return wait


async def _pass_on_stop(stop: asyncio.Event, children) -> None:
    """A signal to `serve` (which sets `stop`) drains the child frontends too: one SIGTERM
    each (a second would cut their drain short)."""
    await stop.wait()
    for child in children:
        if child.is_alive():
            os.kill(child.pid, signal.SIGTERM)


def _join_frontends(children, timeout_s: float) -> None:
    """Wait for the signalled children to drain and exit; kill those that outlast `timeout_s`."""
    for child in children:
        child.join(timeout_s)
        if child.is_alive():
            log.warning("frontend %s did not stop in %ss; killing it", child.name, timeout_s)
            child.kill()
            child.join()
