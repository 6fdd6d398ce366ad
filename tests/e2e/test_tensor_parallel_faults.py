"""A real `pagedserve engine --tensor-parallel-size 2`: kill -9 of its worker, while the engine
is idle, ends the engine promptly with a non-zero code and a clear log line; kill -9 of the
engine (rank 0) ends its worker; Ctrl-C to the whole group drains it cleanly."""

from __future__ import annotations

import os
import re
import signal
import time

import pytest

from helpers import build_tiny_model

PROMPT_S = 10.0  # how soon each side must notice


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory, bundled_tokenizer):
    return build_tiny_model("llama", tmp_path_factory.mktemp("tp-llama"), bundled_tokenizer)


def start_tp_engine(procs, model) -> tuple[object, int]:
    """The engine process, once it listens, and its worker's pid (from its start-up log)."""
    engine = procs.start_engine(f"tcp://127.0.0.1:{procs.free_port()}", "--model", str(model),
                                "--tensor-parallel-size", "2", "--max-model-len", "512")
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline and engine.poll() is None:
        log = procs.log_tail(engine, 100)
        workers = re.search(r"tensor parallel: 2 ranks over gloo \(workers (\d+)\)", log)
        if workers and "listening on" in log:
            return engine, int(workers.group(1))
        time.sleep(0.1)
    procs.stop(engine)
    raise RuntimeError("engine did not start:\n" + procs.log_tail(engine))


def gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"  # exited, not yet reaped
    except FileNotFoundError:
        return True


def test_killing_a_worker_stops_the_idle_engine(procs, tiny_llama):
    engine, worker = start_tp_engine(procs, tiny_llama)
    try:
        time.sleep(0.5)  # idle: nothing is running
        killed = time.monotonic()
        os.kill(worker, signal.SIGKILL)
        code = engine.wait(PROMPT_S)
        elapsed = time.monotonic() - killed
    finally:
        procs.stop(engine)
    time.sleep(0.2)  # the log drain thread catches up
    assert code != 0
    assert "tensor-parallel worker rank 1 exited (code -9); stopping the engine" in procs.log_tail(engine)
    assert elapsed < PROMPT_S


def test_killing_the_engine_ends_its_worker(procs, tiny_llama):
    engine, worker = start_tp_engine(procs, tiny_llama)
    engine.kill()
    engine.wait()
    deadline = time.monotonic() + PROMPT_S
    while not gone(worker) and time.monotonic() < deadline:
        time.sleep(0.1)
    if not gone(worker):
        os.kill(worker, signal.SIGKILL)
        pytest.fail(f"worker {worker} outlived its engine by {PROMPT_S}s")


def test_ctrl_c_to_the_process_group_drains_the_engine(procs, tiny_llama):
    """Ctrl-C reaches every process of the group, workers included: they ignore it, the engine
    drains (no frontend: at once), stops them itself and exits 0, leaving no shared memory."""
    engine, worker = start_tp_engine(procs, tiny_llama)
    try:
        os.kill(worker, signal.SIGINT)  # as the terminal would, then the engine
        os.kill(worker, signal.SIGTERM)
        engine.send_signal(signal.SIGINT)
        code = engine.wait(PROMPT_S)
    finally:
        procs.stop(engine)
    time.sleep(0.2)
    log = procs.log_tail(engine, 100)
    assert code == 0, log
    assert "drained" in log and "exited (code" not in log
    deadline = time.monotonic() + PROMPT_S
    while not gone(worker) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert gone(worker)
    assert not [f for f in os.listdir("/dev/shm") if f.startswith(f"pagedserve-tp-{engine.pid}-")]
