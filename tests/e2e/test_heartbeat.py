"""A starting or busy engine must never look dead: the frontend counts an engine as lost
after 3 s without an answer (--engine-timeout-s), so heartbeats must be answered while the
engine loads, right after the handshake, and while one model step runs for seconds.

A frontend that blocks its own event loop (a tokenizer load or a lazy `import transformers`
in a callback) sends no pings and reads no pongs meanwhile; its silence check must not
blame the engine for that.
"""

from __future__ import annotations

import os
import re
import signal
import threading
import time

import zmq

from grpc_client import Result, generate, greedy, user
from common.v1 import engine_ipc_pb2 as ipc, generation_pb2 as gen
from pagedserve.health import ping_engine

ENGINE_TIMEOUT_S = 3.0  # the frontend's default --engine-timeout-s
LONG_PROMPT = list(range(1000, 2500))  # 1,500 tokens: one prefill step of seconds on a CPU core


def _first_requests(fe) -> dict[str, Result | Exception]:
    """What a client sends the moment the frontend is SERVING, all at once: a chat (the first
    one renders a chat template), text with logprobs, and a long prompt."""
    requests = {
        "chat": dict(chat=user("Hi there"), sampling=greedy(8)),
        "text": dict(text="Once upon a time", sampling=greedy(8, logprobs=5)),
        "long": dict(token_ids=gen.TokenIds(ids=LONG_PROMPT), sampling=greedy(4)),
    }
    results: dict[str, Result | Exception] = {}

    def run(name: str, kwargs: dict) -> None:
        try:
            results[name] = generate(fe, timeout=300, **kwargs)
        except Exception as e:  # noqa: BLE001 - reported by the assertion below
            results[name] = e

    threads = [threading.Thread(target=run, args=item) for item in requests.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def test_frontend_never_loses_a_starting_or_busy_engine(procs):
    address = f"tcp://127.0.0.1:{procs.free_port()}"
    engine = procs.start_engine(address)
    fe = None
    try:
        fe = procs.start_frontend(address)  # says Hello while the engine still loads, as `serve` does
        fe.wait_serving()
        results = _first_requests(fe)
        time.sleep(ENGINE_TIMEOUT_S + 1)  # a loss shows within the timeout of a silence
        log = "".join(fe.proc.log)
        assert "engine lost" not in log, log
        assert log.count("connected to engine") == 1, log
        failed = {name: r for name, r in results.items() if isinstance(r, Exception)}
        assert not failed, failed
    finally:
        if fe is not None:
            fe.close()
        procs.stop(engine)


def _wait_for(what: str, ok, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not ok():
        assert time.monotonic() < deadline, f"no {what} in {timeout_s}s"
        time.sleep(0.2)


def test_a_reconnecting_frontend_is_the_same_frontend(procs):
    """An engine that stops answering for longer than the frontend's timeout (here: SIGSTOP) is
    lost, and the frontend says Hello on every heartbeat until the engine answers again. The
    engine then knows it: one frontend, reconnected, not one more each heartbeat (issue 44)."""
    address = f"tcp://127.0.0.1:{procs.free_port()}"
    engine = procs.start_engine(address)
    fe = None
    try:
        fe = procs.start_frontend(address)
        fe.wait_serving()
        os.kill(engine.pid, signal.SIGSTOP)
        try:
            _wait_for("engine loss", lambda: "engine lost" in "".join(fe.proc.log), timeout_s=30)
            time.sleep(1.5)  # Hellos queue up for the stopped engine, one per heartbeat
        finally:
            os.kill(engine.pid, signal.SIGCONT)
        _wait_for("reconnect", lambda: "".join(fe.proc.log).count("connected to engine") >= 2)
        pong = ping_engine(address, timeout_s=10)
        assert pong is not None and len(pong.frontends) == 1, pong
        log = procs.log_tail(engine, 500)
        assert len(re.findall(r"frontend \w+ connected", log)) == 1, log
        assert re.search(r"frontend \w+ reconnected", log), log
    finally:
        if fe is not None:
            fe.close()
        procs.stop(engine)


class _Peer:
    """A bare frontend on the engine's socket: Hello, then Pings, timing each Pong."""

    def __init__(self, address: str) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.IDENTITY, b"probe")
        self.sock.connect(address)
        self.sent_at: dict[int, float] = {}
        self.longest_pong_wait_s = 0.0
        self.finished: set[str] = set()

    def send(self, msg: ipc.EngineRequest) -> None:
        self.sock.send(msg.SerializeToString())

    def handshake(self, timeout_s: float = 120) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.send(ipc.EngineRequest(hello=ipc.Hello(frontend_id="probe")))
            if self.sock.poll(500) and self._recv().WhichOneof("kind") == "welcome":
                return
        raise TimeoutError("no Welcome from the engine")

    def ping_until_finished(self, request_ids: set[str], interval_s: float, timeout_s: float) -> None:
        deadline, seq, next_ping = time.monotonic() + timeout_s, 0, 0.0
        while not request_ids <= self.finished:
            now = time.monotonic()
            assert now < deadline, f"requests {request_ids - self.finished} did not finish"
            if now >= next_ping:
                seq += 1
                self.sent_at[seq] = now
                self.send(ipc.EngineRequest(ping=ipc.Ping(seq=seq)))
                next_ping = now + interval_s
            if self.sock.poll(10):
                self._recv()
        waiting = [time.monotonic() - t for t in self.sent_at.values()]
        self.longest_pong_wait_s = max([self.longest_pong_wait_s, *waiting])

    def _recv(self) -> ipc.EngineResponse:
        msg = ipc.EngineResponse.FromString(self.sock.recv())
        kind = msg.WhichOneof("kind")
        if kind == "pong" and msg.pong.seq in self.sent_at:
            waited = time.monotonic() - self.sent_at.pop(msg.pong.seq)
            self.longest_pong_wait_s = max(self.longest_pong_wait_s, waited)
        elif kind == "outputs":
            self.finished |= {o.request_id for o in msg.outputs.outputs if o.finish_reason}
        return msg

    def close(self) -> None:
        self.send(ipc.EngineRequest(bye=ipc.Bye()))
        self.sock.close(linger=100)
        self.ctx.term()


def test_engine_answers_pings_during_a_long_step(procs):
    address = f"tcp://127.0.0.1:{procs.free_port()}"
    engine = procs.start_engine(address)
    peer = _Peer(address)
    try:
        peer.handshake()
        started = time.monotonic()
        peer.send(ipc.EngineRequest(add=ipc.AddRequest(
            request_id="long", prompt_token_ids=LONG_PROMPT,
            sampling=gen.SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))))
        peer.ping_until_finished({"long"}, interval_s=0.1, timeout_s=300)
        took_s = time.monotonic() - started
        # The I/O thread answers while the main thread is inside torch (which releases the GIL).
        assert peer.longest_pong_wait_s < 1.0, (
            f"a Pong took {peer.longest_pong_wait_s:.2f}s while a {took_s:.1f}s request ran\n"
            + procs.log_tail(engine))
    finally:
        peer.close()
        procs.stop(engine)
