"""EngineHealth: grpc.health.v1 for the engine process, for Kubernetes' native `grpc:` probes.

    service                 SERVING while
    ""                      the process is up and its main loop went round in the last
                            `liveness_timeout_s` (a step hung that long fails liveness)
    pagedserve.v1.Engine    the model is loaded, the socket bound, and the engine not draining

The gRPC server runs on its own threads; a monitor thread reads the EngineProc's heartbeat
and drain state every `poll_interval_s` and sets both statuses, so Check and Watch answer
without touching the main loop. Before `attach()` (the model still loading) "" is SERVING and
the engine service NOT_SERVING: the startup probe waits on the latter.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent import futures
from typing import Protocol

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

log = logging.getLogger("pagedserve.engine")

ENGINE_SERVICE = "pagedserve.v1.Engine"
# The main loop goes round at least every 0.5 s when idle, and a step takes milliseconds to a
# few seconds; a minute of silence is a hang, not a slow step (a first CUDA step included).
LIVENESS_TIMEOUT_S = 60.0
POLL_INTERVAL_S = 0.5
_SERVING = health_pb2.HealthCheckResponse.SERVING
_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class Watched(Protocol):
    """What the monitor reads from EngineProc (plain attributes, written by its main thread)."""

    last_progress_s: float  # time.monotonic() of the main loop's last round
    drain_deadline: float | None  # set on the first SIGTERM
    stopping: threading.Event


class EngineHealth:
    def __init__(self, host: str, port: int, liveness_timeout_s: float = LIVENESS_TIMEOUT_S,
                 poll_interval_s: float = POLL_INTERVAL_S) -> None:
        self.liveness_timeout_s = liveness_timeout_s
        self.poll_interval_s = poll_interval_s
        self.servicer = health.HealthServicer()
        self.servicer.set("", _SERVING)
        self.servicer.set(ENGINE_SERVICE, _NOT_SERVING)
        # A Watch holds a worker for as long as it streams: past 4 RPCs, refuse (RESOURCE_EXHAUSTED)
        # rather than queue the kubelet's Checks behind them.
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="engine-health"),
                                  maximum_concurrent_rpcs=4)
        health_pb2_grpc.add_HealthServicer_to_server(self.servicer, self.server)
        self.port = self.server.add_insecure_port(f"{host}:{port}")
        self.server.start()
        self.proc: Watched | None = None
        self.stopped = threading.Event()
        self.monitor = threading.Thread(target=self._monitor, name="engine-health-monitor", daemon=True)
        self.monitor.start()
        print(f"health listening on {host}:{self.port} (grpc.health.v1: \"\", {ENGINE_SERVICE})", flush=True)

    def attach(self, proc: Watched) -> None:
        """The engine is loaded and bound: from now on the statuses follow `proc`."""
        self.proc = proc

    def statuses(self, now_s: float) -> tuple[int, int]:
        """(liveness, readiness) as the monitor would set them at `now_s`."""
        proc = self.proc
        if proc is None:
            return _SERVING, _NOT_SERVING
        alive = now_s - proc.last_progress_s <= self.liveness_timeout_s
        ready = alive and proc.drain_deadline is None and not proc.stopping.is_set()
        return (_SERVING if alive else _NOT_SERVING), (_SERVING if ready else _NOT_SERVING)

    def stop(self) -> None:
        self.stopped.set()
        self.monitor.join(timeout=5)
        self.servicer.enter_graceful_shutdown()  # every service NOT_SERVING
        self.server.stop(grace=None)

    def _monitor(self) -> None:
        last = None
        while not self.stopped.wait(self.poll_interval_s):
            current = self.statuses(time.monotonic())
            if current == last:
                continue
            if last is not None and current[0] != last[0]:
                log.warning("liveness %s: the main loop last went round %.0fs ago",
                            health_pb2.HealthCheckResponse.ServingStatus.Name(current[0]),
                            time.monotonic() - self.proc.last_progress_s)
            self.servicer.set("", current[0])
            self.servicer.set(ENGINE_SERVICE, current[1])
            last = current
