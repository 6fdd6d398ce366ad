"""`pagedserve serve --api-server-count 2`: two frontend processes on the same gRPC and HTTP
ports (SO_REUSEPORT), both linked to the one engine, stopped together."""

from __future__ import annotations

import os
import signal
import time
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import httpx
import pytest

from grpc_client import generate, greedy
from common.v1 import generation_pb2_grpc
from test_operations import metric, scrape


def _metrics(port: int) -> dict | None:
    try:
        return scrape(f"http://127.0.0.1:{port}/metrics")
    except (urllib.error.URLError, ConnectionError):
        return None


def _connected(port: int) -> bool:
    """Whether the frontend serving /metrics on `port` has its engine (and so its listeners)."""
    samples = _metrics(port)
    return samples is not None and metric(samples, "pagedserve:engine_connected") == 1


def _spawned_frontends(pid: int) -> list[int]:
    """The children of `serve` that are spawned frontends (not the engine)."""
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    return [int(c) for c in children
            if b"multiprocessing" in Path(f"/proc/{c}/cmdline").read_bytes()
            and b"resource_tracker" not in Path(f"/proc/{c}/cmdline").read_bytes()]


@pytest.fixture
def two_frontends(procs):
    grpc_port, http_port, metrics_port = procs.free_port(), procs.free_port(), procs.free_port(span=2)
    proc = procs.pagedserve(
        "serve", "--engine-address", f"tcp://127.0.0.1:{procs.free_port()}", "--api-server-count", "2",
        "--grpc-port", str(grpc_port), "--http-port", str(http_port), "--metrics-port", str(metrics_port),
        "--dtype", "float32", "--num-kv-blocks", "128", "--max-model-len", "512", "--num-threads", "1")
    fe = procs.Frontend(proc, procs.read_grpc_address(proc))
    try:
        fe.wait_serving()
        deadline = time.monotonic() + 120  # the spawned one starts and connects on its own time
        while not all(_connected(metrics_port + i) for i in range(2)) and time.monotonic() < deadline:
            time.sleep(0.2)
        yield fe, grpc_port, http_port, metrics_port
    finally:
        fe.close()


def test_two_frontends_share_the_ports_and_each_serves_its_connections(two_frontends):
    fe, grpc_port, http_port, metrics_port = two_frontends
    spawned = _spawned_frontends(fe.proc.pid)
    assert len(spawned) == 1, spawned
    # Each channel is one connection, which the kernel gives to one of the two listeners. (A
    # local subchannel pool: else gRPC shares one connection between channels to one target.)
    tokens = []
    for _ in range(16):
        options = [("grpc.use_local_subchannel_pool", 1)]
        with grpc.insecure_channel(f"127.0.0.1:{grpc_port}", options=options) as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            fe_like = type("Stub", (), {"generation": stub})
            tokens.append(generate(fe_like, text="Hello there", sampling=greedy(4), timeout=60).tokens[0])
    assert all(t == tokens[0] and len(t) == 4 for t in tokens)  # one engine: the same greedy tokens
    served = [metric(_metrics(metrics_port + i), "pagedserve:grpc_requests_total",
                     method="Generate", code="OK") for i in range(2)]
    assert sum(served) == 16 and min(served) > 0, served
    texts = set()
    for _ in range(8):  # a new connection each: both HTTP listeners answer the same way
        with httpx.Client(base_url=f"http://127.0.0.1:{http_port}", trust_env=False, timeout=60) as client:
            model = client.get("/v1/models").json()["data"][0]["id"]
            r = client.post("/v1/completions", json={"model": model, "prompt": "Hello there", "max_tokens": 4,
                                                     "temperature": 0})
            assert r.status_code == 200, r.text
            texts.add(r.json()["choices"][0]["text"])
    assert len(texts) == 1
    fe.wait_kv_free()


def test_a_signal_stops_every_frontend_and_a_dead_frontend_stops_serve(two_frontends, procs):
    fe, _, _, metrics_port = two_frontends
    spawned = _spawned_frontends(fe.proc.pid)
    os.kill(spawned[0], signal.SIGKILL)  # a crash of the spawned frontend
    assert fe.proc.wait(60) != 0, procs.log_tail(fe.proc)
    assert _metrics(metrics_port) is None and _metrics(metrics_port + 1) is None


def test_api_server_count_needs_fixed_ports(procs):
    proc = procs.pagedserve("serve", "--api-server-count", "2", "--grpc-port", "0")
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 2 and "needs fixed --grpc-port" in out
