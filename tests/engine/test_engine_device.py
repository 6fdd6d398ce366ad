"""The device an engine runs on by default (`--device auto`): on this machine without a GPU,
the bundled model's engine resolves it to cpu, and its Welcome tells a frontend so."""

from __future__ import annotations

import threading

import zmq

from common.v1 import engine_ipc_pb2 as ipc
from engine.config import EngineConfig
from engine.core import EngineCore
from engine.models.loader import eos_token_ids, load_tokenizer
from engine.proc import EngineProc
from helpers import free_port


def test_a_default_engine_runs_on_cpu_and_its_welcome_says_so(bundled_path):
    config = EngineConfig(num_kv_blocks=32, max_model_len=256, num_threads=1)  # device: the default
    core = EngineCore(config, eos_token_ids(load_tokenizer(bundled_path)))
    assert core.config.device == "cpu" and str(core.model_runner.kv_caches[0].device) == "cpu"
    address = f"tcp://127.0.0.1:{free_port()}"
    proc = EngineProc(core, address, "smollm2")
    main_loop = threading.Thread(target=proc.run, name="engine-main")
    main_loop.start()
    ctx = zmq.Context()
    frontend = ctx.socket(zmq.DEALER)
    frontend.setsockopt(zmq.IDENTITY, b"device-test")  # a frontend's id: the engine answers no other
    try:
        frontend.connect(address)
        frontend.send(ipc.EngineRequest(hello=ipc.Hello(address="test")).SerializeToString())
        assert frontend.poll(30_000), "no Welcome"
        reply = ipc.EngineResponse.FromString(frontend.recv())
        assert reply.WhichOneof("kind") == "welcome" and reply.welcome.device == "cpu"
    finally:
        frontend.close(linger=0)
        ctx.term()
        proc.stop()
        main_loop.join(10)
        core.close()
    assert not main_loop.is_alive()
