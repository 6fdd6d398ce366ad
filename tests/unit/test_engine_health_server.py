"""EngineHealth's two statuses against a stand-in EngineProc: loading, ready, draining, hung."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from engine.health_server import ENGINE_SERVICE, EngineHealth

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


@pytest.fixture
def health():
    server = EngineHealth("127.0.0.1", 0, liveness_timeout_s=1.0, poll_interval_s=0.05)
    yield server
    server.stop()


def fake_proc() -> SimpleNamespace:
    return SimpleNamespace(last_progress_s=time.monotonic(), drain_deadline=None, stopping=threading.Event())


def check(health: EngineHealth, service: str) -> int:
    with grpc.insecure_channel(f"127.0.0.1:{health.port}") as channel:
        request = health_pb2.HealthCheckRequest(service=service)
        return health_pb2_grpc.HealthStub(channel).Check(request, timeout=5).status


def wait_for(health: EngineHealth, service: str, status: int, timeout_s: float = 5) -> None:
    deadline = time.monotonic() + timeout_s
    while check(health, service) != status:
        assert time.monotonic() < deadline, f"{service!r} never became {status}"
        time.sleep(0.02)


def test_statuses_follow_the_proc(health):
    now = time.monotonic()
    assert health.statuses(now) == (SERVING, NOT_SERVING)  # loading: alive, not ready
    proc = fake_proc()
    health.attach(proc)
    assert health.statuses(now) == (SERVING, SERVING)
    assert health.statuses(proc.last_progress_s + 1.0) == (SERVING, SERVING)  # at the threshold
    assert health.statuses(proc.last_progress_s + 1.01) == (NOT_SERVING, NOT_SERVING)  # a hung step
    proc.drain_deadline = now + 30
    assert health.statuses(now) == (SERVING, NOT_SERVING)
    proc.drain_deadline = None
    proc.stopping.set()
    assert health.statuses(now) == (SERVING, NOT_SERVING)


def test_check_answers_what_the_monitor_sets(health):
    assert check(health, "") == SERVING
    assert check(health, ENGINE_SERVICE) == NOT_SERVING
    proc = fake_proc()
    health.attach(proc)
    wait_for(health, ENGINE_SERVICE, SERVING)
    proc.last_progress_s -= 5  # the main loop stopped going round
    wait_for(health, "", NOT_SERVING)
    assert check(health, ENGINE_SERVICE) == NOT_SERVING
    proc.last_progress_s = time.monotonic() + 60  # it recovered
    wait_for(health, "", SERVING)
    wait_for(health, ENGINE_SERVICE, SERVING)
    with pytest.raises(grpc.RpcError) as err:
        check(health, "pagedserve.v1.Nothing")
    assert err.value.code() == grpc.StatusCode.NOT_FOUND


def test_stop_closes_the_port():
    server = EngineHealth("127.0.0.1", 0)
    port = server.port
    server.stop()
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        with pytest.raises(grpc.RpcError) as err:
            health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=2)
    assert err.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


def test_watch_streams_the_drain(health):
    proc = fake_proc()
    with grpc.insecure_channel(f"127.0.0.1:{health.port}") as channel:
        stream = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=ENGINE_SERVICE),
                                                           timeout=10)
        assert next(stream).status == NOT_SERVING  # loading
        health.attach(proc)
        assert next(stream).status == SERVING
        proc.drain_deadline = time.monotonic() + 30  # SIGTERM
        assert next(stream).status == NOT_SERVING
        stream.cancel()
