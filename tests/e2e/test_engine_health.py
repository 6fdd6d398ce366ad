"""`pagedserve engine --health-port`: a real engine's grpc.health.v1, as Kubernetes probes it.

One engine, one life: loading (liveness only), ready (the probe command exits 0), a frontend
connected and SIGTERM (draining: readiness NOT_SERVING, liveness still SERVING, the engine
still up), the frontend's Bye (the engine exits 0 and the port closes)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import grpc
import zmq
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.v1 import engine_ipc_pb2 as ipc

ENGINE = "pagedserve.v1.Engine"
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def check(address: str, service: str) -> int | grpc.StatusCode:
    """The status, or the RPC's error code (no server yet, or gone)."""
    with grpc.insecure_channel(address) as channel:
        try:
            request = health_pb2.HealthCheckRequest(service=service)
            return health_pb2_grpc.HealthStub(channel).Check(request, timeout=2).status
        except grpc.RpcError as e:
            return e.code()


def wait_status(address: str, service: str, want, proc: subprocess.Popen, log_tail, timeout_s: float = 90) -> None:
    deadline = time.monotonic() + timeout_s
    while (got := check(address, service)) != want:
        assert proc.poll() is None, f"engine exited:\n{log_tail(proc)}"
        assert time.monotonic() < deadline, f"{service!r} is {got}, never {want}:\n{log_tail(proc)}"
        time.sleep(0.1)


class FakeFrontend:
    """A DEALER that says Hello, so the draining engine waits for it, and Bye to let it go."""

    def __init__(self, address: str) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.IDENTITY, b"health-test")
        self.sock.setsockopt(zmq.LINGER, 1000)
        self.sock.connect(address)
        self.sock.send(ipc.EngineRequest(hello=ipc.Hello(address="test")).SerializeToString())
        assert self.sock.poll(30_000), "no Welcome"
        assert ipc.EngineResponse.FromString(self.sock.recv()).WhichOneof("kind") == "welcome"

    def bye(self) -> None:
        self.sock.send(ipc.EngineRequest(bye=ipc.Bye()).SerializeToString())
        self.sock.close()
        self.ctx.term()


def test_engine_health_through_drain(procs):
    engine_address = f"tcp://127.0.0.1:{procs.free_port()}"
    health = f"127.0.0.1:{procs.free_port()}"
    engine = procs.start_engine(engine_address, "--health-port", health.rsplit(":", 1)[1])
    try:
        wait_status(health, "", SERVING, engine, procs.log_tail, timeout_s=30)  # up before the model
        wait_status(health, ENGINE, SERVING, engine, procs.log_tail)
        probe = [sys.executable, "-m", "pagedserve", "health", "--address", health, "--service", ENGINE]
        done = subprocess.run(probe, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        assert "SERVING" in done.stdout

        frontend = FakeFrontend(engine_address)
        engine.send_signal(signal.SIGTERM)
        wait_status(health, ENGINE, NOT_SERVING, engine, procs.log_tail, timeout_s=5)
        assert check(health, "") == SERVING  # draining is not dead: no restart
        assert engine.poll() is None, "the engine stopped with a frontend still connected"

        frontend.bye()
        assert engine.wait(20) == 0, procs.log_tail(engine)
        assert check(health, "") in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
    finally:
        procs.stop(engine)


def test_health_is_off_by_default():
    from pagedserve.cli import build_parser
    args = build_parser().parse_args(["engine"])
    assert args.health_port is None and args.health_host == "127.0.0.1"
