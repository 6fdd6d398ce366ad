"""The LoRA contract on a real `pagedserve engine` socket: Welcome and Pong list the adapters,
AddRequest.lora_name runs a request with its adapter (HF+PEFT's tokens), an unknown one gets
KIND_NOT_FOUND, LoadLora/UnloadLora answer LoraResult with each kind; and a --lora-modules
adapter above --max-lora-rank stops the start with one clear line."""

from __future__ import annotations

import time

import pytest
import zmq

from common.ipc import outputs_from_batch
from helpers import hf_greedy
from lora_helpers import build_lora_setup, lora_prompts, merged_model
from common.v1 import engine_ipc_pb2 as ipc, generation_pb2 as gen

MAX_NEW = 8
Kind = ipc.LoraResult


@pytest.fixture(scope="module")
def setup(tmp_path_factory, bundled_tokenizer):
    return build_lora_setup(tmp_path_factory.mktemp("lora-engine"), bundled_tokenizer)


class _Peer:
    def __init__(self, address: str) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.IDENTITY, b"lora-test")
        self.sock.connect(address)

    def send(self, **kind) -> None:
        self.sock.send(ipc.EngineRequest(**kind).SerializeToString())

    def recv(self, kind: str, timeout_s: float = 60) -> ipc.EngineResponse:
        """The next message of this kind (others, e.g. stray Pongs, are skipped)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.sock.poll(200):
                msg = ipc.EngineResponse.FromString(self.sock.recv())
                if msg.WhichOneof("kind") == kind:
                    return msg
        raise TimeoutError(f"no {kind} from the engine")

    def handshake(self, timeout_s: float = 120) -> ipc.Welcome:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.send(hello=ipc.Hello(frontend_id="lora-test"))
            try:
                return self.recv("welcome", timeout_s=1).welcome
            except TimeoutError:
                continue
        raise TimeoutError("no Welcome from the engine")

    def generate(self, request_id: str, prompt: list[int], lora_name: str) -> list[int]:
        self.send(add=ipc.AddRequest(request_id=request_id, prompt_token_ids=prompt, lora_name=lora_name,
                                     sampling=gen.SamplingParams(temperature=0, max_tokens=MAX_NEW,
                                                                 ignore_eos=True)))
        tokens = []
        while True:
            out, = outputs_from_batch(self.recv("outputs").outputs)
            tokens += out.new_token_ids
            if out.finish_reason:
                return tokens

    def lora(self, op: str, **fields) -> ipc.LoraResult:
        message = ipc.LoadLora(op_id=op, **fields) if "path" in fields else ipc.UnloadLora(op_id=op, **fields)
        self.send(**{"load_lora" if "path" in fields else "unload_lora": message})
        result = self.recv("lora_result").lora_result
        assert result.op_id == op
        return result

    def close(self) -> None:
        self.send(bye=ipc.Bye())
        self.sock.close(linger=100)
        self.ctx.term()


def test_lora_over_the_engine_socket(setup, procs):
    folder, adapters = setup
    prompt = lora_prompts()[2]
    want = {name: hf_greedy(merged_model(folder, adapters.get(name)), [prompt], MAX_NEW)[0][0]
            for name in ("a", "b")}
    address = f"tcp://127.0.0.1:{procs.free_port()}"
    engine = procs.start_engine(address, "--model", str(folder), "--max-model-len", "512",
                                "--lora-modules", f"a={adapters['a']}", "--max-lora-rank", "8", "--max-loras", "2")
    peer = _Peer(address)
    try:
        welcome = peer.handshake()
        assert (welcome.lora_enabled, welcome.max_lora_rank, welcome.max_loras) == (True, 8, 2)
        assert [(a.name, a.rank) for a in welcome.lora_adapters] == [("a", 8)]
        assert peer.generate("r1", prompt, "a") == want["a"]
        peer.send(add=ipc.AddRequest(request_id="r2", prompt_token_ids=prompt, lora_name="zzz",
                                     sampling=gen.SamplingParams(max_tokens=2)))
        error = peer.recv("error").error
        assert (error.request_id, error.kind) == ("r2", ipc.RequestError.KIND_NOT_FOUND), error
        assert "'zzz' is not loaded" in error.message
        loaded = peer.lora("l1", name="b", path=str(adapters["b"]))
        assert loaded.kind == Kind.KIND_OK and [a.name for a in loaded.adapters] == ["a", "b"], loaded
        assert peer.generate("r3", prompt, "b") == want["b"]
        too_big = peer.lora("l2", name="c", path=str(adapters["c"]))
        assert too_big.kind == Kind.KIND_INVALID and "exceeds --max-lora-rank 8" in too_big.message
        assert peer.lora("l3", name="a", path=str(adapters["b"])).kind == Kind.KIND_CONFLICT
        assert peer.lora("u1", name="nope").kind == Kind.KIND_NOT_FOUND
        unloaded = peer.lora("u2", name="b")
        assert unloaded.kind == Kind.KIND_OK and [a.name for a in unloaded.adapters] == ["a"]
        peer.send(ping=ipc.Ping(seq=1))
        assert list(peer.recv("pong").pong.lora_names) == ["a"]
    finally:
        peer.close()
        procs.stop(engine)


def test_adapter_above_max_rank_stops_the_start(setup, procs):
    folder, adapters = setup
    engine = procs.start_engine(f"tcp://127.0.0.1:{procs.free_port()}", "--model", str(folder),
                                "--max-model-len", "512", "--lora-modules", f"c={adapters['c']}",
                                "--max-lora-rank", "8")
    assert engine.wait(120) == 2
    time.sleep(0.2)  # the drain thread reads the last lines
    log = procs.log_tail(engine)
    assert "cannot start: LoRA 'c': rank 16 exceeds --max-lora-rank 8" in log, log
    assert "Traceback" not in log, log
