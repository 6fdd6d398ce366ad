"""The servers `bench serve` starts for itself: `pagedserve serve`, or the HF baseline.

Both print `grpc listening on HOST:PORT` once bound and report grpc.health.v1 SERVING for
pagedserve.v1.Generation once they can generate, so one class starts, watches and stops either.
`pagedserve serve` started with its engine's /metrics on prints `metrics listening on URL`,
and with its HTTP API on `http listening on HOST:PORT`; the class keeps both too.
"""

from __future__ import annotations

import collections
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import fields

from engine.config import EngineConfig

GENERATION_SERVICE = "pagedserve.v1.Generation"
SERVER_START_TIMEOUT_S = 300
SERVER_STOP_TIMEOUT_S = 30
BACKENDS = ("pagedserve", "hf")


class ServerProcess:
    """A gRPC server as a child: started on a free port, its output drained, stopped with SIGTERM."""

    def __init__(self, name: str, cmd: list[str]) -> None:
        self.name = name
        self.cmd = cmd
        self.proc: subprocess.Popen | None = None
        self.tail: collections.deque[str] = collections.deque(maxlen=40)
        self.address: str | None = None
        self.metrics_url: str | None = None  # the first `metrics listening on` line's, if any
        self.http_url: str | None = None  # http://HOST:PORT of the first `http listening on` line, if any
        self.listening = threading.Event()
        # `pagedserve serve` keeps its frontend up when the engine child dies: spot the traceback.
        self.crashed = False

    def start(self) -> str:
        self.proc = subprocess.Popen(self.cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1"})
        # Drain its output for the whole run: a full pipe would block the server.
        threading.Thread(target=self._drain, daemon=True).start()
        deadline = time.monotonic() + SERVER_START_TIMEOUT_S
        if not self.listening.wait(SERVER_START_TIMEOUT_S) or self.address is None:
            self._fail("never printed `grpc listening on`")
        self._wait_serving(deadline)
        return self.address

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(SERVER_STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            print(f"{self.name} did not stop in {SERVER_STOP_TIMEOUT_S}s; killing it", file=sys.stderr)
            self.proc.kill()
            self.proc.wait()

    def _drain(self) -> None:
        for line in self.proc.stdout:
            self.tail.append(line)
            self.crashed = self.crashed or line.startswith("Traceback")
            metrics = self.metrics_url is None and re.search(r"metrics listening on (http://\S+)", line)
            if metrics:
                self.metrics_url = metrics.group(1)
            http = self.http_url is None and re.search(r"http listening on (\S+:\d+)", line)
            if http:
                self.http_url = f"http://{http.group(1)}"
            match = not self.listening.is_set() and re.search(r"grpc listening on (\S+:\d+)", line)
            if match:
                self.address = match.group(1)
                self.listening.set()
        self.listening.set()  # it exited: wake start() up

    def _wait_serving(self, deadline: float) -> None:
        import grpc
        from grpc_health.v1 import health_pb2, health_pb2_grpc
        with grpc.insecure_channel(self.address) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            while time.monotonic() < deadline and self.proc.poll() is None and not self.crashed:
                try:
                    check = health.Check(health_pb2.HealthCheckRequest(service=GENERATION_SERVICE), timeout=5)
                    if check.status == health_pb2.HealthCheckResponse.SERVING:
                        return
                except grpc.RpcError:
                    pass  # not up yet: poll again
                time.sleep(0.2)
        self._fail(f"{GENERATION_SERVICE} never became SERVING")

    def _fail(self, why: str) -> None:
        self.stop()
        raise RuntimeError(f"{self.name} {why}; its last output:\n" + "".join(self.tail))


def server_for(backend: str, config: EngineConfig, max_concurrent_streams: int,
               engine_metrics: bool = False) -> ServerProcess:
    """The server of `backend` on `config`'s model, dtype and threads; `engine_metrics` turns
    the pagedserve engine's /metrics on (on a free port; the engine then also times its steps)."""
    if backend == "pagedserve":
        metrics = ["--engine-metrics-port", "0"] if engine_metrics else []
        cmd = [sys.executable, "-m", "pagedserve", "serve", "--grpc-port", "0", "--http-port", "0",
               "--engine-address", f"tcp://127.0.0.1:{free_port()}", *metrics,
               "--max-concurrent-streams", str(max_concurrent_streams), *engine_flags(config)]
        return ServerProcess("pagedserve serve", cmd)
    if backend == "hf":
        cmd = [sys.executable, "-m", "bench.hf_server", "--grpc-port", "0", "--dtype", config.dtype,
               "--device", config.device]
        for flag, value in (("--model", config.model), ("--tokenizer", config.tokenizer),
                            ("--num-threads", config.num_threads), ("--max-model-len", config.max_model_len)):
            cmd += [flag, str(value)] if value is not None else []
        return ServerProcess("bench.hf_server", cmd)
    raise ValueError(f"backend: must be one of {', '.join(BACKENDS)}, got {backend!r}")


def engine_flags(config: EngineConfig) -> list[str]:
    """The command-line flags that rebuild `config` (see engine.arg_utils)."""
    flags = []
    for f in fields(EngineConfig):
        value, flag = getattr(config, f.name), "--" + f.name.replace("_", "-")
        if isinstance(value, bool):
            flags.append(flag if value else "--no-" + flag[2:])
        elif isinstance(value, dict):  # --lora-modules NAME=PATH ...
            flags += [flag, *(f"{k}={v}" for k, v in value.items())] if value else []
        elif value is not None:
            flags += [flag, str(value)]
    return flags


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_cpu_s(pid: int | None) -> dict[str, float] | None:
    """CPU seconds (user + system) used so far by a server we started: its own process (for
    `pagedserve serve`, the frontend) and its children (the engine). None without one."""
    if pid is None:
        return None
    import psutil
    try:
        proc = psutil.Process(pid)
        children = proc.children(recursive=True)
        own = proc.cpu_times()
        return {"frontend": own.user + own.system,
                "engine": sum(t.user + t.system for t in (c.cpu_times() for c in children))}
    except psutil.Error:  # it died meanwhile: the run reports its failures anyway
        return None


def cpu_ms_per_token(before: dict[str, float] | None, after: dict[str, float] | None,
                     output_tokens: int) -> dict[str, float]:
    """Each server process's CPU milliseconds per streamed output token over a run: the
    frontend's is what bounds one frontend process (the GIL) at high concurrency."""
    if before is None or after is None or not output_tokens:
        return {}
    return {f"{name}_cpu_ms_per_token": 1e3 * (after[name] - before[name]) / output_tokens for name in before}
