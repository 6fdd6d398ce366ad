"""Real processes on loopback: an engine, frontends, generated gRPC stubs."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.v1 import embedding_pb2_grpc, generation_pb2_grpc, info_pb2, info_pb2_grpc, tokenization_pb2_grpc
from helpers import free_port

ROOT = Path(__file__).resolve().parents[2]
# One torch thread: the machine's few cores are shared, and OpenMP threads that outnumber
# the free cores slow every step down many times over.
ENGINE_FLAGS = ["--dtype", "float32", "--num-kv-blocks", "512", "--max-model-len", "2048", "--num-threads", "1"]


def pagedserve(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "pagedserve", *args], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})


def drain(proc: subprocess.Popen, seen: list[str] = ()) -> subprocess.Popen:
    """Keep reading a child's output (a full pipe would block it); the tail stays in `proc.log`,
    after the lines the caller `seen` already."""
    proc.log = deque(seen, maxlen=500)

    def read() -> None:
        for line in proc.stdout:
            proc.log.append(line)

    threading.Thread(target=read, name=f"drain-{proc.pid}", daemon=True).start()
    return proc


def log_tail(proc: subprocess.Popen, lines: int = 40) -> str:
    return "".join(list(getattr(proc, "log", ()))[-lines:])


def stop(proc: subprocess.Popen, sig: int = signal.SIGTERM, timeout_s: float = 20) -> int:
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


def read_grpc_address(proc: subprocess.Popen, timeout_s: float = 60) -> str:
    """Wait for the frontend's `grpc listening on HOST:PORT` line."""
    return read_addresses(proc, timeout_s, http=False)[0]


def read_addresses(proc: subprocess.Popen, timeout_s: float = 60, http: bool = True) -> tuple[str, str | None]:
    """Wait for the frontend's `grpc listening on HOST:PORT` line and, with `http`, the
    `http listening on HOST:PORT` line that follows it. Returns (grpc address, http URL or None)."""
    deadline = time.monotonic() + timeout_s
    seen, found = [], {}
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line and proc.poll() is not None:
            break
        seen.append(line)
        match = re.search(r"(grpc|http) listening on (\S+:\d+)", line)
        if match:
            found[match.group(1)] = match.group(2)
        if "grpc" in found and ("http" in found or not http):
            drain(proc, seen)
            return found["grpc"], f"http://{found['http']}" if "http" in found else None
    raise RuntimeError("frontend did not start:\n" + "".join(seen[-30:]))


@dataclass
class Frontend:
    proc: subprocess.Popen
    address: str
    http_url: str | None = None  # http://HOST:PORT of the HTTP API; None when it is off
    channel: grpc.Channel = field(init=False)

    def __post_init__(self) -> None:
        self.channel = grpc.insecure_channel(self.address)
        self.generation = generation_pb2_grpc.GenerationStub(self.channel)
        self.tokenization = tokenization_pb2_grpc.TokenizationStub(self.channel)
        self.info = info_pb2_grpc.InfoStub(self.channel)
        self.embedding = embedding_pb2_grpc.EmbeddingStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)

    def health_status(self, service: str = "pagedserve.v1.Generation") -> int:
        return self.health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status

    def wait_serving(self, serving: bool = True, timeout_s: float = 120) -> None:
        want = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                if self.health_status() == want:
                    return
            except grpc.RpcError:
                pass
            if serving and self.proc.poll() is not None:  # say why now, not after the whole timeout
                raise RuntimeError(f"frontend {self.address} exited with code {self.proc.returncode} before "
                                   f"serving:\n{log_tail(self.proc)}")
            time.sleep(0.2)
        raise TimeoutError(f"frontend {self.address} never became {'SERVING' if serving else 'NOT_SERVING'}")

    def server_info(self) -> info_pb2.ServerInfo:
        return self.info.GetServerInfo(info_pb2.GetServerInfoRequest(), timeout=5)

    def wait_kv_free(self, timeout_s: float = 10) -> info_pb2.ServerInfo:
        """Poll until every KV block is free and nothing runs: the leak check over gRPC."""
        deadline = time.monotonic() + timeout_s
        while True:
            info = self.server_info()
            if info.kv_blocks_free == info.kv_blocks_total and not info.num_running and not info.num_waiting:
                return info
            if time.monotonic() > deadline:
                raise AssertionError(f"KV blocks not freed: {info}")
            time.sleep(0.1)

    def close(self) -> None:
        self.channel.close()
        stop(self.proc)


def start_engine(address: str, *flags: str) -> subprocess.Popen:
    return drain(pagedserve("engine", "--address", address, *ENGINE_FLAGS, *flags))


def start_frontend(engine_address: str, *flags: str) -> Frontend:
    args = ["--engine-address", engine_address, "--grpc-port", "0", "--http-port", "0", *flags]
    proc = pagedserve("frontend", *args)
    http_ports = [value for flag, value in zip(args, args[1:]) if flag == "--http-port"]
    return Frontend(proc, *read_addresses(proc, http=http_ports[-1] != "off"))  # the last one given wins


def start_serve(*flags: str, timeout_s: float = 120) -> Frontend:
    """`pagedserve serve` (engine and frontend) on free ports with these flags, once it has
    printed its addresses (then `wait_serving` for its engine)."""
    proc = pagedserve("serve", "--grpc-port", "0", "--http-port", "0", "--engine-address",
                      f"tcp://127.0.0.1:{free_port()}", *flags)
    return Frontend(proc, *read_addresses(proc, timeout_s=timeout_s))


@contextlib.contextmanager
def serving(*flags: str, timeout_s: float = 120) -> Iterator[Frontend]:
    """`start_serve` with these flags, serving (its engine up) until the block ends."""
    fe = start_serve(*flags, timeout_s=timeout_s)
    try:
        fe.wait_serving(timeout_s=timeout_s)
        yield fe
    finally:
        fe.close()


class Servers:
    """The engines and frontends one test worker shares between its modules: one engine per
    distinct set of engine flags, one frontend per (engine, frontend flags), each started when
    first asked for and stopped when the worker ends. A module that needs a server of its own
    kind asks for it by its flags; one that stops or kills processes starts its own (`procs`).
    Modules run one after another in a worker, so a shared server is idle between them, but
    it keeps what they did: tests read metric counters as deltas, and prefix-cache hits as
    what their own requests made."""

    def __init__(self, data_dir: Path) -> None:
        self.data_dir = data_dir  # the frontends' --data-dir (batch files), not the user's cache
        self._engines: dict[tuple[str, ...], SimpleNamespace] = {}
        self._frontends: dict[tuple[tuple[str, ...], tuple[str, ...]], Frontend] = {}

    def engine(self, *flags: str) -> SimpleNamespace:
        """The shared engine with ENGINE_FLAGS and `flags`: .address, .proc (its log in .proc.log)."""
        engine = self._engines.get(flags)
        if engine is None:
            address = f"tcp://127.0.0.1:{free_port()}"
            engine = self._engines[flags] = SimpleNamespace(address=address, proc=start_engine(address, *flags))
        elif engine.proc.poll() is not None:  # a test broke it: say so here, not as a timeout later
            raise RuntimeError(f"the shared engine {flags} exited with code {engine.proc.returncode}:\n"
                               + log_tail(engine.proc))
        return engine

    def frontend(self, *flags: str, engine: tuple[str, ...] = ()) -> Frontend:
        """The shared frontend with `flags` on the shared engine with `engine` flags, serving."""
        key = (engine, flags)
        fe = self._frontends.get(key)
        if fe is None:
            address = self.engine(*engine).address
            fe = start_frontend(address, "--data-dir", str(self.data_dir), *flags)
            fe.engine_address, fe.data_dir = address, self.data_dir
            self._frontends[key] = fe
        elif fe.proc.poll() is not None:
            raise RuntimeError(f"the shared frontend {flags} exited with code {fe.proc.returncode}:\n"
                               + log_tail(fe.proc))
        fe.wait_serving()
        return fe

    def close(self) -> None:
        for fe in self._frontends.values():
            fe.close()
        for engine in self._engines.values():
            stop(engine.proc)


@pytest.fixture(scope="session")
def servers(tmp_path_factory):
    pool = Servers(tmp_path_factory.mktemp("frontend-data"))
    yield pool
    pool.close()


@pytest.fixture(scope="session")
def engine_address(servers):
    """The worker's engine with ENGINE_FLAGS (the bundled model, fp32, one thread)."""
    return servers.engine().address


@pytest.fixture(scope="session")
def frontend(servers):
    """The worker's frontend (default flags) on that engine."""
    return servers.frontend()


@pytest.fixture(scope="session")
def limited_frontend(servers):
    """A second frontend on that engine that admits one stream at a time."""
    return servers.frontend("--max-concurrent-streams", "1")


@pytest.fixture(scope="session")
def procs():
    """This module's process helpers, for tests that start their own engines and frontends
    (a test module cannot import them: two conftest modules share that name)."""
    return SimpleNamespace(free_port=free_port, pagedserve=pagedserve, stop=stop, drain=drain,
                           log_tail=log_tail, read_grpc_address=read_grpc_address, read_addresses=read_addresses,
                           Frontend=Frontend, start_engine=start_engine, start_frontend=start_frontend,
                           start_serve=start_serve, serving=serving)
