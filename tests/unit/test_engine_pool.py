"""EnginePool without engines: DNS discovery, drain-then-drop, refusing an engine whose model
facts disagree, routing only to ready engines. Real sockets (ZeroMQ connects to nothing)."""

from __future__ import annotations

import asyncio

from common.v1 import engine_ipc_pb2 as ipc
from frontend.engine_pool import EnginePool, EngineState
from frontend.router import RoundRobin


def welcome(engine_id: str, **facts) -> ipc.Welcome:
    base = dict(model_name="m", max_model_len=1024, block_size=16, vocab_size=100, eos_token_ids=[2],
                kv_blocks_total=64)
    return ipc.Welcome(engine_id=engine_id, **{**base, **facts})


def handshake(pool: EnginePool, address: str, w: ipc.Welcome) -> None:
    """What an engine's Welcome does to its client."""
    pool.engines[address].client._on_welcome(w)


def test_dns_names_engines_and_unknown_ones_are_kept():
    async def run():
        pool = EnginePool(RoundRobin(), "fe")
        await pool.start([], dns="localhost:5999", dns_interval_s=0.05)
        await asyncio.sleep(0.3)
        found = set(pool.engines)
        await pool.close()
        return found

    found = asyncio.run(run())
    assert "tcp://127.0.0.1:5999" in found
    assert found <= {"tcp://127.0.0.1:5999", "tcp://[::1]:5999"}


def test_states_refusal_and_routing():
    async def run():
        changes = []
        welcomed = []
        pool = EnginePool(RoundRobin(), "fe", on_change=lambda: changes.append(1), on_welcome=welcomed.append)
        await pool.start(["tcp://127.0.0.1:1", "tcp://127.0.0.1:2", "tcp://127.0.0.1:3"])
        states = [e.state for e in pool.engines.values()]
        assert states == [EngineState.CONNECTING] * 3
        assert pool.route([1, 2, 3]) is None
        handshake(pool, "tcp://127.0.0.1:1", welcome("a"))
        handshake(pool, "tcp://127.0.0.1:2", welcome("b", block_size=32))
        handshake(pool, "tcp://127.0.0.1:3", welcome("c", kv_blocks_total=48))
        assert pool.min_kv_blocks() == 48  # the refused engine's pool does not count
        engines = pool.engines
        assert engines["tcp://127.0.0.1:2"].state is EngineState.REFUSED
        assert "block_size is 32 but the pool's is 16" in engines["tcp://127.0.0.1:2"].refused
        assert [w.engine_id for w in welcomed] == ["a", "c"] and pool.num_ready == 2
        routed = {pool.route([1, 2, 3]).address for _ in range(4)}
        assert routed == {"tcp://127.0.0.1:1", "tcp://127.0.0.1:3"}
        assert pool.route([1], exclude={"tcp://127.0.0.1:1"}).address == "tcp://127.0.0.1:3"
        engines["tcp://127.0.0.1:3"].client.draining = True
        assert engines["tcp://127.0.0.1:3"].state is EngineState.DRAINING
        assert {pool.route([1]).address for _ in range(3)} == {"tcp://127.0.0.1:1"}
        engines["tcp://127.0.0.1:1"].client._lose("test")
        assert engines["tcp://127.0.0.1:1"].state is EngineState.LOST
        assert pool.route([1]) is None and pool.num_ready == 0 and changes
        await pool.close()

    asyncio.run(run())


def test_removed_engine_drains_then_drops():
    async def run():
        pool = EnginePool(RoundRobin(), "fe")
        await pool.start([])
        await pool.add("tcp://127.0.0.1:1")  # as DNS adds one
        handshake(pool, "tcp://127.0.0.1:1", welcome("a"))
        engine = pool.route([1])
        engine.client.open_stream("r1")  # a request of ours runs there
        pool.remove(engine.address)
        assert engine.state is EngineState.DRAINING and pool.route([1]) is None
        assert engine.address in pool.engines
        engine.client.close_stream("r1")
        pool.release(engine)
        assert engine.address not in pool.engines
        await asyncio.sleep(0.05)  # its client closes
        await pool.close()

    asyncio.run(run())


def test_dns_never_removes_an_engine_given_by_address():
    async def run():
        pool = EnginePool(RoundRobin(), "fe")
        await pool.start(["tcp://127.0.0.1:1"])
        handshake(pool, "tcp://127.0.0.1:1", welcome("a"))
        await pool.add("tcp://127.0.0.1:1")  # DNS lists it too, then stops listing it
        pool.remove("tcp://127.0.0.1:1")
        state = pool.engines["tcp://127.0.0.1:1"].state
        await pool.close()
        return state

    assert asyncio.run(run()) is EngineState.READY
