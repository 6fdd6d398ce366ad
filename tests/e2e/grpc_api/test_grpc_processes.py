"""gRPC end to end, processes coming and going: an engine killed and restarted, a frontend
gone, two frontends on one engine, `pagedserve serve` stopping both on SIGTERM. These start
their own processes where they kill them."""

from __future__ import annotations

import signal
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import psutil
import pytest

from grpc_client import (LONG, SERVING, STORY, Background, generate, generate_error, greedy, port_is_free, request,
                         wait_info)
from common.v1 import generation_pb2 as gen, info_pb2

pytestmark = pytest.mark.heavy(48)  # seconds on the 2-core CI machine: scheduled first


# -- engine killed and restarted ---------------------------------------------------------

def test_engine_kill_and_restart(procs):
    address = f"tcp://127.0.0.1:{procs.free_port()}"
    engine = procs.start_engine(address)
    fe = procs.start_frontend(address)
    new_engine = None
    try:
        fe.wait_serving()
        old_engine_id = fe.server_info().engines[0].id
        stream = Background(fe, request(text=STORY, sampling=gen.SamplingParams(**LONG)), timeout=120)
        stream.wait_first_chunk()
        killed_at = time.monotonic()
        engine.send_signal(signal.SIGKILL)
        engine.wait(10)
        stream.join(timeout_s=15)
        assert stream.error is not None and stream.error.code() == grpc.StatusCode.UNAVAILABLE, stream.error
        assert stream.ended_at - killed_at < 8, stream.ended_at - killed_at
        assert all(m.WhichOneof("kind") != "finished" for m in stream.messages)
        fe.wait_serving(False, timeout_s=5)
        assert fe.health_status("") == SERVING
        error = generate_error(fe, request(text="Hello", sampling=greedy(2)))
        assert error.code() == grpc.StatusCode.UNAVAILABLE

        new_engine = procs.start_engine(address)
        fe.wait_serving(timeout_s=120)
        r = generate(fe, text="The capital of France is", sampling=greedy(4))
        assert r.finished[0].usage.completion_tokens == 4 and "Paris" in r.texts[0]
        info = fe.wait_kv_free()
        assert info.engines[0].id != old_engine_id
    finally:
        fe.close()
        procs.stop(engine)
        if new_engine is not None:
            procs.stop(new_engine)


# -- a frontend going away ------------------------------------------------------------------

@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "sigkill"])
def test_frontend_gone_frees_its_requests(frontend, procs, engine_address, sig):
    """A stopped frontend (no drain time) says Bye on the way out and the engine aborts its
    requests; a killed one is forgotten by the engine after 10 s of silence (engine/proc.py
    FRONTEND_TIMEOUT_S). Either way the blocks come back, seen from another frontend."""
    doomed = procs.start_frontend(engine_address, "--drain-timeout-s", "0")
    try:
        doomed.wait_serving()
        stream = Background(doomed, request(text=STORY, sampling=gen.SamplingParams(**LONG)), timeout=120)
        stream.wait_first_chunk()
        busy = wait_info(frontend, lambda i: i.num_running == 1 and i.kv_blocks_free < i.kv_blocks_total)
        assert busy.num_running == 1, busy
        gone_at = time.monotonic()
        doomed.proc.send_signal(sig)
        doomed.proc.wait(20)
        stream.join()
        assert stream.error is not None
        # SIGTERM: well before the engine's 10 s silence timeout, so the frontend said so
        frontend.wait_kv_free(timeout_s=7 if sig == signal.SIGTERM else 16)
        assert time.monotonic() - gone_at < (8 if sig == signal.SIGTERM else 16)
    finally:
        doomed.close()
    # the engine forgot the gone frontend when it aborted its requests
    deadline = time.monotonic() + 5
    while doomed.address in {p.address for p in frontend.server_info().frontends}:
        assert time.monotonic() < deadline, "the engine still lists the gone frontend"
        time.sleep(0.5)


# -- two frontends on one engine ---------------------------------------------------------

def test_two_frontends_share_one_engine(frontend, limited_frontend, engine_address):
    jobs = [(frontend, "The capital of France is"), (limited_frontend, "def fibonacci(n):")]
    sequential = [generate(fe, text=p, sampling=greedy(12)).tokens[0] for fe, p in jobs]
    # at the same time, and with the same request id: ids are namespaced per frontend
    with ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(generate, fe, request_id="same-id", text=p, sampling=greedy(12)) for fe, p in jobs]
        results = [f.result() for f in futures]
    for r, want in zip(results, sequential):
        assert r.started.request_id == "same-id"
        assert r.tokens[0] == want
    assert results[0].tokens[0] != results[1].tokens[0]
    addresses = {frontend.address, limited_frontend.address}
    for fe, _ in jobs:
        info = fe.wait_kv_free()
        assert addresses <= {p.address for p in info.frontends}, info
        assert len({p.id for p in info.frontends if p.address in addresses}) == 2
        assert [e.address for e in info.engines] == [engine_address]
    assert frontend.server_info().engines[0].id == limited_frontend.server_info().engines[0].id != ""


# -- `pagedserve serve` ------------------------------------------------------------------

def test_serve_runs_both_and_stops_both_on_sigterm(procs):
    engine_port = procs.free_port()
    proc = procs.pagedserve("serve", "--grpc-port", "0", "--http-port", "0", "--engine-address", f"tcp://127.0.0.1:{engine_port}",
                            "--dtype", "float32", "--num-kv-blocks", "64", "--max-model-len", "1024",
                            "--num-threads", "1")
    children: list[psutil.Process] = []
    try:
        fe = procs.Frontend(proc, procs.read_grpc_address(proc))
        children = psutil.Process(proc.pid).children(recursive=True)
        assert children, "serve started no engine process"
        fe.wait_serving(timeout_s=120)
        assert not port_is_free(engine_port)
        r = generate(fe, text="The capital of France is", sampling=greedy(4))
        assert "Paris" in r.texts[0]
        info = fe.wait_kv_free()
        assert info.kv_blocks_total == 64
        assert fe.info.GetModelInfo(info_pb2.GetModelInfoRequest(), timeout=10).max_model_len == 1024
        fe.channel.close()

        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0, procs.log_tail(proc)
        gone, alive = psutil.wait_procs(children, timeout=20)
        assert not alive, f"left running: {alive}"
        deadline = time.monotonic() + 10
        while not port_is_free(engine_port):
            assert time.monotonic() < deadline, "the engine port is still bound"
            time.sleep(0.2)
    finally:
        if proc.poll() is None:  # failed half way: take its engine down with it
            children += psutil.Process(proc.pid).children(recursive=True)
        procs.stop(proc)
        for child in children:
            if child.is_running():
                child.kill()
