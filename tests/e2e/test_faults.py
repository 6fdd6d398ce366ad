"""Process failure and hostile peers, with real processes: an engine killed mid-stream, and
garbage, truncated, oversized or out-of-protocol messages on the engine's ZeroMQ port."""

from __future__ import annotations

import signal
import time

import grpc
import pytest
import zmq

from grpc_client import GENERATION, LONG, NOT_SERVING, SERVING, STORY, Background, generate, greedy, request
from common.ipc import outputs_from_batch
from common.v1 import engine_ipc_pb2 as ipc, generation_pb2 as gen
from pagedserve.health import ping_engine


def _engine_and_frontend(procs):
    address = f"tcp://127.0.0.1:{procs.free_port()}"
    engine = procs.start_engine(address)
    fe = procs.start_frontend(address)
    fe.wait_serving()
    fe.engine, fe.engine_address = engine, address
    yield fe
    fe.close()
    procs.stop(fe.engine)


@pytest.fixture
def fresh_pair(procs):
    """Its own engine and frontend, for a test that kills the engine."""
    yield from _engine_and_frontend(procs)


@pytest.fixture(scope="module")
def engine_and_frontend(procs):
    yield from _engine_and_frontend(procs)


def test_engine_kill_ends_every_stream_within_2s(fresh_pair, procs):
    fe = fresh_pair
    streams = [Background(fe, request(text=f"{STORY} {i}", sampling=gen.SamplingParams(**LONG)), timeout=120)
               for i in range(4)]
    for stream in streams:
        stream.wait_first_chunk()
    killed_at = time.monotonic()
    fe.engine.send_signal(signal.SIGKILL)
    for stream in streams:
        stream.join(timeout_s=10)
        assert stream.error is not None and stream.error.code() == grpc.StatusCode.UNAVAILABLE, stream.error
        assert stream.ended_at - killed_at < 2, stream.ended_at - killed_at
    assert fe.health_status(GENERATION) == NOT_SERVING
    assert fe.health_status("") == SERVING
    # a new engine at the same address: the frontend serves again without a restart of its own
    fe.engine = procs.start_engine(fe.engine_address)
    fe.wait_serving(timeout_s=120)
    assert generate(fe, text="Hello", sampling=greedy(3)).finished[0].usage.completion_tokens == 3
    fe.wait_kv_free()


class Peer:
    """A raw ZeroMQ DEALER on the engine port, for messages no frontend would send."""

    def __init__(self, address: str, identity: bytes | None = None) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        if identity is not None:
            self.sock.setsockopt(zmq.IDENTITY, identity)
        self.sock.connect(address)

    def send(self, *frames: bytes) -> None:
        self.sock.send_multipart(list(frames))

    def replies(self, timeout_s: float = 1.0) -> list[ipc.EngineResponse]:
        out = []
        while self.sock.poll(int(timeout_s * 1000)):
            out.append(ipc.EngineResponse.FromString(self.sock.recv()))
        return out

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()


def hello(frontend_id: str) -> bytes:
    return ipc.EngineRequest(hello=ipc.Hello(frontend_id=frontend_id)).SerializeToString()


def add(request_id: str, prompt: list[int], max_tokens: int = 2) -> bytes:
    return ipc.EngineRequest(add=ipc.AddRequest(request_id=request_id, prompt_token_ids=prompt, sampling=gen.SamplingParams(
        temperature=0, max_tokens=max_tokens))).SerializeToString()


HOSTILE = {
    "garbage": [b"\xff\x00 not a protobuf \x13\x37" * 10],
    "truncated": [add("t", list(range(100, 200)))[:-7]],
    "empty": [b""],
    "three frames": [b"a", b"b", b"c"],
    "unknown kind": [b"\x52\x00"],  # field 10, never defined
    "add before hello": [add("early", [100, 101])],
    "abort before hello": [ipc.EngineRequest(abort=ipc.AbortRequests(request_ids=["x"])).SerializeToString()],
    "bye before hello": [ipc.EngineRequest(bye=ipc.Bye()).SerializeToString()],
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_messages_are_dropped(engine_and_frontend, name):
    fe = engine_and_frontend
    peer = Peer(fe.engine_address)
    try:
        peer.send(*HOSTILE[name])
        assert peer.replies(timeout_s=0.5) == []  # nothing is answered to a broken message
    finally:
        peer.close()
    assert ping_engine(fe.engine_address, timeout_s=5) is not None
    assert generate(fe, text="Hello", sampling=greedy(2)).finished[0].usage.completion_tokens == 2
    assert fe.engine.poll() is None
    fe.wait_kv_free()


def test_oversized_message_and_bad_requests_after_hello(engine_and_frontend):
    fe = engine_and_frontend
    big = Peer(fe.engine_address)
    try:
        big.send(b"\x00" * (17 * 2**20))  # over the engine's 16 MiB: ZeroMQ drops the link
        time.sleep(0.5)
    finally:
        big.close()
    peer = Peer(fe.engine_address, identity=b"fuzzpeer")
    try:
        peer.send(hello("fuzzpeer"))
        assert [r.WhichOneof("kind") for r in peer.replies()] == ["welcome"]
        peer.send(add("oov", [10**9]))  # token id outside the vocabulary
        peer.send(add("empty", []))
        peer.send(add("huge", [100], max_tokens=10**9))
        errors = {r.error.request_id: r.error for r in peer.replies() if r.WhichOneof("kind") == "error"}
        assert set(errors) == {"oov", "empty", "huge"}
        assert all(e.kind == ipc.RequestError.KIND_INVALID for e in errors.values())
        assert "vocabulary" in errors["oov"].message and "maximum length" in errors["huge"].message
        peer.send(add("fine", [100, 101], max_tokens=3))
        outputs = [o for r in peer.replies(timeout_s=5) if r.WhichOneof("kind") == "outputs"
                   for o in outputs_from_batch(r.outputs)]
        assert sum(len(o.new_token_ids) for o in outputs) == 3 and outputs[-1].finish_reason == "length"
        peer.send(ipc.EngineRequest(bye=ipc.Bye()).SerializeToString())
    finally:
        peer.close()
    bad_identity = Peer(fe.engine_address, identity=b"has:colon")
    try:
        bad_identity.send(hello("has:colon"))
        assert bad_identity.replies(timeout_s=0.5) == []  # ":" would break the id namespace
    finally:
        bad_identity.close()
    assert generate(fe, text="Hello", sampling=greedy(2)).finished[0].usage.completion_tokens == 2
    assert fe.engine.poll() is None
    fe.wait_kv_free()
