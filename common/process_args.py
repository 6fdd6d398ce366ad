"""Command-line pieces every pagedserve process shares: the engine's default endpoint, the
log level, the drain timeout, the default CPU thread count, the number types of flags,
stopping engine children, and freezing the start-up heap."""

from __future__ import annotations

import argparse
import gc
import logging
import os
import subprocess

DEFAULT_ADDRESS = "tcp://127.0.0.1:5570"  # the engine's ZeroMQ endpoint, and a frontend's default


def default_num_threads() -> int:
    """CPU threads a process takes when --num-threads is not given: $OMP_NUM_THREADS, the
    usual knob, when set; else the CPUs this process may run on (a container's or taskset's
    cpuset, which os.cpu_count() ignores: threads beyond it only wait on each other)."""
    value = os.environ.get("OMP_NUM_THREADS", "")
    if value.isdigit() and int(value) > 0:
        return int(value)
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def freeze_startup_heap() -> None:
    """Once a process is ready: collect, then move everything alive (the imported modules,
    a model's and a tokenizer's objects: most of the heap) out of the garbage collector's
    sight. A full collection in the serving loop then traverses only what was allocated
    since, not the whole start-up heap (vLLM's engine and API server do the same)."""
    gc.collect()
    gc.freeze()


def add_log_level_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                        help="log level (default: info)")


def add_drain_arg(parser: argparse.ArgumentParser, what: str) -> None:
    parser.add_argument("--drain-timeout-s", type=float, default=30.0,
                        help=f"{what} (default: 30)")


def configure_logging(level: str) -> None:
    import logging
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for client in ("httpx", "httpx2"):  # a line per HTTP request (a Hub download's): only their warnings
        logging.getLogger(client).setLevel(max(logging.WARNING, logging.getLogger().level))


def positive_int(text: str) -> int:
    """An argparse type: an integer >= 1."""
    return _checked(int(text), lambda v: v >= 1, ">= 1", text)


def non_negative_int(text: str) -> int:
    """An argparse type: an integer >= 0."""
    return _checked(int(text), lambda v: v >= 0, ">= 0", text)


def positive_float(text: str) -> float:
    """An argparse type: a number > 0."""
    return _checked(float(text), lambda v: v > 0, "> 0", text)


def _checked(value, ok, what: str, text: str):
    if not ok(value):
        raise argparse.ArgumentTypeError(f"must be {what}, got {text}")
    return value


ENGINE_STOP_TIMEOUT_S = 15  # seconds an engine child gets to drain and exit before it is killed


def stop_engines(engines: list[subprocess.Popen], timeout_s: float = ENGINE_STOP_TIMEOUT_S) -> None:
    """SIGTERM every engine child (each drains), then wait for each; kill one that outlasts
    `timeout_s`."""
    for engine in engines:
        engine.terminate()
    for engine in engines:
        try:
            engine.wait(timeout_s)
        except subprocess.TimeoutExpired:
            logging.getLogger("pagedserve").warning("engine did not stop in %ss; killing it", timeout_s)
            engine.kill()
            engine.wait()
