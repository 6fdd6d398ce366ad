"""`pagedserve engine`: the engine process on its own."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from typing import NoReturn

from common.metrics_http import add_metrics_args
from common.process_args import (DEFAULT_ADDRESS, add_drain_arg, add_log_level_arg, configure_logging,
                                 freeze_startup_heap)
from engine.arg_utils import add_engine_args, engine_config_from_args

def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--address", default=DEFAULT_ADDRESS,
                   help=f"ZeroMQ endpoint to bind, tcp://HOST:PORT or ipc://PATH (default: {DEFAULT_ADDRESS})")
    add_log_level_arg(p)
    add_drain_arg(p, "on SIGTERM, keep serving until every frontend is gone and nothing runs, at "
                     "most this long; a second signal stops at once")
    add_metrics_args(p)
    p.add_argument("--health-port", type=int, default=None, metavar="PORT",
                   help='serve grpc.health.v1 on this port, for Kubernetes grpc probes: "" is liveness '
                        "(SERVING unless a step hangs for a minute), pagedserve.v1.Engine readiness "
                        "(SERVING once loaded and bound, NOT_SERVING while draining); 0 picks a free "
                        "one (default: off)")
    p.add_argument("--health-host", default="127.0.0.1",
                   help="host the health port binds; 0.0.0.0 for kubelet probes (default: 127.0.0.1)")
    add_engine_args(p)


def run(args: argparse.Namespace) -> int:
    configure_logging(args.log_level)
    from engine.core import EngineCore
    from common.errors import LoraError
    from engine.models.loader import eos_token_ids, load_tokenizer, tokenizer_files
    from engine.models.source import model_files, served_model_name, tokenizer_path
    from engine.proc import EngineProc
    try:
        config = engine_config_from_args(args)
    except ValueError as e:  # flags that do not go together: one line and exit 2, as argparse does
        print(f"pagedserve engine: error: {e}", file=sys.stderr)
        return 2
    health = None
    if args.health_port is not None:  # first: "" answers SERVING while the model loads
        from engine.health_server import EngineHealth
        health = EngineHealth(args.health_host, args.health_port)
    path = model_files(config)  # a Hub id's files: the command's check fetched them (common/hub.py)
    name = served_model_name(config.model, path)
    metrics_on = args.metrics_port is not None
    tokenizer = load_tokenizer(path, tokenizer_path(config))
    try:
        core = EngineCore(config, eos_token_ids(tokenizer), log_stats=metrics_on, tokenizer=tokenizer)
    except (LoraError, ValueError) as e:  # an adapter, or flags the model cannot take (a --max-model-len past
        # its positions): one clear line, no traceback (--log-level debug shows it)
        log = logging.getLogger("pagedserve.engine")
        log.error("cannot start: %s", e)
        log.debug("cannot start", exc_info=True)
        if health is not None:
            health.stop()
        return 2
    metrics = None
    if metrics_on:
        from engine.metrics import EngineMetrics
        from common.metrics_http import serve_metrics
        metrics = EngineMetrics(name)
        serve_metrics(args.metrics_host, args.metrics_port)
    files = tokenizer_files(tokenizer)
    if core.structured_output is not None and "tokenizer.json" in files:
        core.structured_output.tokenizer_json = files["tokenizer.json"].decode()
    if core.structured_output is not None:
        core.structured_output.prepare()  # before the sockets: it holds the GIL (manager.py)
    proc = EngineProc(core, args.address, name, metrics, args.drain_timeout_s, files)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: proc.on_signal())
    if health is not None:
        health.attach(proc)
    freeze_startup_heap()  # the model is loaded and warmed up: a full collection need not walk it
    try:
        proc.run()
    finally:
        if health is not None:
            health.stop()
        core.close()
    _exit_now()


def _exit_now() -> NoReturn:
    """Exit 0 without the interpreter's teardown: collecting the model's, the tokenizer's and
    torch's objects took 7 s on a busy 2-core machine, time that would come on top of the drain
    timeout that orchestrators size their grace period for. The sockets, the workers and the
    health port are closed already; only the logs are left to flush."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
