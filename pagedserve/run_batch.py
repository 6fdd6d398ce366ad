"""`pagedserve run-batch -i requests.jsonl -o results.jsonl`: a file in OpenAI's batch format,
offline.

One engine process starts as `pagedserve serve` starts it (the engine flags passed through,
on a private ipc endpoint); the frontend runs here, with no gRPC or HTTP listener: each line
goes to the frontend's own HTTP app in-process (frontend/batch/runner.py), so it gets exactly
what the route would answer over the network, 400s included. Lines run --max-concurrency at a
time; results are written as they finish (not in input order: match them by custom_id). A bad
line is an error line, never the end of the run: the exit code is 0 once the file is processed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time

from common.process_args import add_log_level_arg, configure_logging, positive_int, stop_engines
from engine.arg_utils import add_engine_args
from frontend.main import add_http_arguments, http_options_from_args

log = logging.getLogger("pagedserve")
ENGINE_POLL_S = 0.2


def add_arguments(p: argparse.ArgumentParser) -> None:
    _add_own_arguments(p)
    add_engine_args(p)


def _add_own_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of run-batch itself; the rest are the engine's, passed on to it."""
    p.add_argument("-i", "--input-file", required=True, metavar="PATH",
                   help="the requests: JSONL, one {custom_id, method, url, body} per line, url one of "
                        "/v1/chat/completions, /v1/completions, /v1/responses (a generating model), or "
                        "/v1/embeddings (an embedding model)")
    p.add_argument("-o", "--output-file", required=True, metavar="PATH",
                   help="the results: JSONL, one {id, custom_id, response: {status_code, request_id, body}, "
                        "error} per input line, in the order they finish")
    p.add_argument("--max-concurrency", type=positive_int, default=256, metavar="N",
                   help="requests in flight at once: enough to keep the engine's batch full (default: 256)")
    p.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="model name(s) a body's model may give (default: the model's own name)")
    add_http_arguments(p)
    add_log_level_arg(p)


def engine_argv(argv: list[str]) -> list[str]:
    """`argv` without run-batch's own flags: what the engine is given."""
    own = argparse.ArgumentParser(add_help=False)
    _add_own_arguments(own)
    return own.parse_known_args(argv)[1]


def run(args: argparse.Namespace, argv: list[str]) -> int:
    configure_logging(args.log_level)
    # One line per request would bury the progress bar; warnings still show.
    for name in ("pagedserve.http", "httpx"):
        logging.getLogger(name).setLevel(max(logging.WARNING, logging.getLogger().level))
    if not os.path.isfile(args.input_file):
        print(f"error: --input-file {args.input_file}: no such file", file=sys.stderr)
        return 2
    if os.path.exists(args.output_file) and os.path.samefile(args.input_file, args.output_file):
        print("error: --output-file is the input file", file=sys.stderr)
        return 2
    try:
        # Opened before the engine loads, so a bad path fails at once; line-buffered, so what a
        # stopped run wrote is there.
        out = open(args.output_file, "w", buffering=1)
    except OSError as e:
        print(f"error: --output-file: {e}", file=sys.stderr)
        return 2
    import uvloop
    with out, tempfile.TemporaryDirectory(prefix="pagedserve-batch-") as folder:
        address = f"ipc://{folder}/engine"
        engine = subprocess.Popen([sys.executable, "-m", "pagedserve", "engine", "--address", address,
                                   "--log-level", args.log_level, *engine_argv(argv)])
        try:
            return uvloop.run(_run(args, address, engine, out))
        except (KeyboardInterrupt, asyncio.CancelledError):  # Ctrl-C, or SIGTERM (_run's handler)
            print(f"interrupted; the results so far are in {args.output_file}", file=sys.stderr)
            return 130
        finally:
            stop_engines([engine])


async def _run(args: argparse.Namespace, address: str, engine: subprocess.Popen, out) -> int:
    from prometheus_client import CollectorRegistry
    from tqdm import tqdm

    from frontend.batch.jobs import ENCODING
    from frontend.batch.runner import BatchRunner, count_requests
    from frontend.http.app import build_app
    from frontend.http.context import HttpContext
    from frontend.metrics import FrontendMetrics
    from frontend.pooling import served_task

    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, asyncio.current_task().cancel)
    llm, ready = _frontend(address, args.max_concurrency, args.limit_mm_per_prompt)
    exited = asyncio.ensure_future(_exit_code(engine))
    await llm.pool.start([address])
    try:
        if not await _first(ready.wait(), exited):
            log.error("the engine exited with code %s before it was ready", exited.result())
            return exited.result() or 1
        if llm.input is None:
            return 1  # on_welcome said why
        # A registry of its own: nothing scrapes this process.
        ctx = HttpContext(llm, FrontendMetrics(CollectorRegistry()), args.served_model_name or [],
                          options=http_options_from_args(args))
        runner = BatchRunner(build_app(ctx), asyncio.Semaphore(args.max_concurrency),
                             task=served_task(llm.welcome.pooler))
        with open(args.input_file, **ENCODING) as lines:
            total = count_requests(lines)
        done = {True: 0, False: 0}  # by result.ok
        start = time.monotonic()
        with open(args.input_file, **ENCODING) as lines, tqdm(total=total, unit="req", disable=None) as bar:
            def on_result(result) -> None:
                out.write(json.dumps(result.record) + "\n")
                done[result.ok] += 1
                bar.update()
            if not await _first(runner.run(lines, on_result), exited):
                log.error("the engine exited with code %s; %d of %d results written", exited.result(),
                          sum(done.values()), total)
                return exited.result() or 1
        print(f"{total} requests in {time.monotonic() - start:.1f}s: {done[True]} succeeded, {done[False]} failed; "
              f"results in {args.output_file}", file=sys.stderr)
        return 0
    finally:
        exited.cancel()
        await llm.pool.close()


async def _first(work, exited: asyncio.Future) -> bool:
    """Run `work` unless the engine exits first: True if it finished (its exception raised),
    False if the engine exited (`work` is cancelled)."""
    task = asyncio.ensure_future(work)
    try:
        await asyncio.wait([task, exited], return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():
        return False
    task.result()
    return True


async def _exit_code(engine: subprocess.Popen) -> int:
    """The engine's exit code, once it exits. Polled: a thread blocked in wait() would keep the
    loop from closing while the engine still runs."""
    while engine.poll() is None:
        await asyncio.sleep(ENGINE_POLL_S)
    return engine.returncode


def _frontend(address: str, max_streams: int, max_images: int):
    """AsyncLLM over one engine, as frontend/server.py makes it, without its listeners; and an
    event set once the engine's handshake has come (llm.input is None if the tokenizer it
    handed over could not be loaded)."""
    from frontend.async_llm import AsyncLLM
    from frontend.engine_pool import FRONTEND_ID, EnginePool
    from frontend.router import make_policy

    llm, ready = AsyncLLM(None, max_streams, max_images=max_images), asyncio.Event()

    def on_welcome(welcome) -> None:
        try:
            llm.on_welcome(welcome)
        except Exception:  # noqa: BLE001 - said here; the run ends with it
            log.exception("could not load the tokenizer")
            ready.set()

    def on_change() -> None:
        if llm.pool.num_ready and llm.input is not None:
            ready.set()

    llm.pool = EnginePool(make_policy("round_robin"), FRONTEND_ID, on_change=on_change, on_welcome=on_welcome)
    return llm, ready
